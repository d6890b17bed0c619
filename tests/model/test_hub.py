"""Hub ids as MODEL (issue 38): resolved through huggingface_hub from a hub-cache layout built here (no network:
HF_HUB_OFFLINE=1), downloads only what a run needs, the served name is the id; and the warm-up that runs before
a server or LLM() says it is ready."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import build_tiny_model
from server_process import ServerProcess

from fp8cache import LLM, SamplingParams
from fp8cache.engine import warmup
from fp8cache.model import hub
from fp8cache.model.loader import ModelLoadError, resolve_model_path
from fp8cache.server.serve import default_served_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("hub-tiny")))


def cache_layout(cache: str, repo: str, commit: str, source: str, ref: str = "main",
                 skip: tuple[str, ...] = ()) -> str:
    """huggingface_hub's cache layout: models--org--name/{refs/<ref> -> commit, snapshots/<commit>/files}."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", ref), "w") as f:
        f.write(commit)
    for name in os.listdir(source):
        if name not in skip:
            shutil.copy(os.path.join(source, name), snapshot)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_from_the_cache_offline(tiny, tmp_path, offline):
    cache = str(tmp_path / "hub")
    snapshot = cache_layout(cache, "org/tiny", COMMIT, tiny)
    assert resolve_model_path("org/tiny", download_dir=cache) == snapshot
    other = cache_layout(cache, "org/tiny", OTHER, tiny, ref="v1")
    assert resolve_model_path("org/tiny", revision="v1", download_dir=cache) == other
    assert resolve_model_path("org/tiny", revision=OTHER, download_dir=cache) == other


def test_llm_runs_a_hub_id_as_its_folder(tiny, tmp_path, offline):
    cache = str(tmp_path / "hub")
    cache_layout(cache, "org/tiny", COMMIT, tiny)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kwargs = {"device": "cpu", "kv_cache_memory": "4MiB", "log": lambda m: None}
    by_id = LLM(model="org/tiny", download_dir=cache, **kwargs).generate([[5, 6, 7]], params)[0]
    by_folder = LLM(model=tiny, **kwargs).generate([[5, 6, 7]], params)[0]
    assert by_id.outputs[0].token_ids == by_folder.outputs[0].token_ids


def test_not_cached_and_offline_is_one_clear_error(tiny, tmp_path, offline):
    cache = str(tmp_path / "hub")
    with pytest.raises(hub.HubError, match=r"org/absent is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model_path("org/absent", download_dir=cache)
    # A snapshot without its weights is not taken for the model.
    cache_layout(cache, "org/partial", COMMIT, tiny, skip=("model.safetensors",))
    with pytest.raises(hub.HubError, match="org/partial is not in the Hugging Face cache"):
        resolve_model_path("org/partial", download_dir=cache)


def test_the_cli_reports_a_missing_hub_model_in_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "org/absent", "hello", "--download-dir",
                           str(tmp_path / "hub"), "--device", "cpu"], capture_output=True, text=True, env=env,
                          timeout=300, check=False, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "org/absent is not in the Hugging Face cache" in done.stderr and "Traceback" not in done.stderr


def test_paths_and_shape_names_are_not_hub_ids(tmp_path):
    assert hub.looks_like_repo_id("org/name") and hub.looks_like_repo_id("gpt2")
    assert not hub.looks_like_repo_id("./models/x") and not hub.looks_like_repo_id("~/m")
    assert not hub.looks_like_repo_id("a/b/c") and not hub.looks_like_repo_id("scales.json")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nothing" / "here"))
    with pytest.raises(ModelLoadError, match="--load-format dummy"):  # a shipped shape, not a hub id
        resolve_model_path("llama-3.1-8b")


def test_a_download_fetches_only_what_a_run_needs(tiny, tmp_path, monkeypatch):
    """Config and tokenizer files first, then exactly the weight files the index names (never *.bin)."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    snapshot = str(tmp_path / "snapshot")
    repo_files = {**{n: os.path.join(tiny, n) for n in os.listdir(tiny) if n != "model.safetensors"},
                  "model-00001-of-00001.safetensors": os.path.join(tiny, "model.safetensors"),
                  "consolidated.safetensors": os.path.join(tiny, "model.safetensors"),
                  "pytorch_model.bin": os.path.join(tiny, "config.json")}
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    (tmp_path / "index.json").write_text(json.dumps(index))
    repo_files["model.safetensors.index.json"] = str(tmp_path / "index.json")
    calls = []

    def fake_snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None, **kw):
        import fnmatch

        from huggingface_hub.errors import LocalEntryNotFoundError

        calls.append((local_files_only, allow_patterns))
        if local_files_only and not os.path.isdir(snapshot):
            raise LocalEntryNotFoundError("not cached")
        os.makedirs(snapshot, exist_ok=True)
        if not local_files_only:
            for name, src in repo_files.items():
                if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                    shutil.copy(src, os.path.join(snapshot, name))
        return snapshot

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert hub.resolve("org/tiny", progress=False) == snapshot
    fetched = sorted(os.listdir(snapshot))
    assert "model-00001-of-00001.safetensors" in fetched and "tokenizer.json" in fetched
    assert "consolidated.safetensors" not in fetched and "pytorch_model.bin" not in fetched
    assert [c[0] for c in calls] == [True, False, False]
    assert calls[2][1] == ["model-00001-of-00001.safetensors"]
    assert "*.py" not in calls[1][1]  # remote code only with --trust-remote-code


def test_the_served_name_of_a_hub_id_is_the_id(tmp_path):
    assert default_served_name("org/tiny", str(tmp_path / "snapshots" / COMMIT)) == "org/tiny"
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert default_served_name(str(folder), str(folder)) == "my-model"
    assert default_served_name(None, "/x/SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"


def test_fp8kv_run_serves_a_hub_id_under_its_name_after_the_warm_up(tiny, tmp_path):
    cache = str(tmp_path / "hub")
    cache_layout(cache, "org/tiny", COMMIT, tiny)
    server = ServerProcess(["org/tiny", "--download-dir", cache, "--device", "cpu", "--kv-cache-memory", "4MiB"],
                           str(tmp_path / "server.log"), env={"HF_HUB_OFFLINE": "1"})
    try:
        with server.client() as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["org/tiny"]
            done = c.post("/v1/completions", json={"model": "org/tiny", "prompt": "the city", "max_tokens": 3})
            assert done.status_code == 200, done.text
        output = server.output()
        assert output.index("warm-up: a prefill and a decode step ran") < output.index("fp8kv serving org/tiny")
    finally:
        assert server.stop() == 0


# ---- the warm-up ----------------------------------------------------------------------------------------

def test_llm_warm_up_leaves_no_trace_and_keeps_calculated_scales_pending(tiny):
    llm = LLM(model=tiny, device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_memory="4MiB",
              log=lambda m: None)
    engine = llm.engine
    stats = engine.stats
    assert (stats.num_steps, stats.num_generated_tokens, stats.num_prefill_tokens_computed, stats.blocks_used) == \
        (0, 0, 0, 0)
    assert engine.runner.kv_spec.scales_pending  # still to come from the first real batch
    llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=2, temperature=0))
    assert not engine.runner.kv_spec.scales_pending


def test_a_model_that_cannot_run_fails_at_start_in_one_line(tiny, monkeypatch):
    from fp8cache.model.runner import ModelRunner

    def broken(self, *args, **kwargs):
        raise NotImplementedError("Cannot copy out of meta tensor; no data!\nsecond line")

    monkeypatch.setattr(ModelRunner, "_forward", broken)
    with pytest.raises(warmup.EngineStartError) as err:
        LLM(model=tiny, device="cpu", kv_cache_memory="4MiB", log=lambda m: None)
    assert str(err.value) == ("the model failed its warm-up (one prefill and one decode step) and cannot serve: "
                              "NotImplementedError: Cannot copy out of meta tensor; no data!")


def test_fp8kv_run_exits_2_before_ready_when_the_model_cannot_run(tiny, tmp_path):
    prelude = ("from fp8cache.model.runner import ModelRunner\n"
               "def broken(self, *a, **k):\n    raise NotImplementedError('Cannot copy out of meta tensor')\n"
               "ModelRunner._forward = broken")
    with pytest.raises(RuntimeError) as err:
        ServerProcess([tiny, "--device", "cpu", "--kv-cache-memory", "4MiB"], str(tmp_path / "server.log"),
                      python_prelude=prelude)
    message = str(err.value)
    assert "exited with 2 before serving" in message
    assert "the model failed its warm-up" in message and "Traceback" not in message


def test_calibrate_and_the_early_scales_check_take_a_hub_id(tiny, tmp_path, offline):
    from click.testing import CliRunner

    from fp8cache.config import EngineConfig
    from fp8cache.kvcache.scales import ScalesFileError
    from fp8cache.model.preflight import check_engine_scales
    from launcher.calibrate import calibrate

    cache = str(tmp_path / "hub")
    cache_layout(cache, "org/tiny", COMMIT, tiny)
    out = tmp_path / "scales.json"
    run = CliRunner().invoke(calibrate, ["org/tiny", "--download-dir", cache, "--num-samples", "2", "--max-seq-len",
                                         "64", "-o", str(out)])
    assert run.exit_code == 0, run.output
    doc = json.loads(out.read_text())
    assert len(doc["kv_cache"]["k_scaling_factor"]["0"]) == 2  # the tiny model's layers
    # A file made for another model is refused before any weight loads: the hub model's shape is read from the cache.
    doc["kv_cache"]["scaling_factor"]["0"]["2"] = 0.5
    for table in ("k_scaling_factor", "v_scaling_factor"):
        del doc["kv_cache"][table]
    out.write_text(json.dumps(doc))
    config = EngineConfig(model="org/tiny", download_dir=cache, kv_cache_dtype="fp8_e4m3",
                          quantization_param_path=str(out))
    with pytest.raises(ScalesFileError, match="the file has 3 layers, the model 2"):
        check_engine_scales(config)
