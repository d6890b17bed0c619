"""`fp8kv bench kernels | throughput | capacity | serve`: small real runs whose figures must add up.

The references are independent of the bench code: the token counts the requests asked for, the cache
sizes computed from the model's config and torch's element sizes, the WikiText-2 text itself, and for
`bench serve` a fake OpenAI server that knows which of its answers it broke.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from fastapi import FastAPI, Request  # module level: the route's annotation must resolve by name
from fastapi.responses import JSONResponse, StreamingResponse

import fp8cache.ops as fp8cache_ops
from fp8cache.platform import cpu_info
from launcher import bench as bench_commands

SMALL = ["--num-prompts", "4", "--input-len", "32", "--output-len", "8"]
# One thread: on a shared machine with 2 cores, two OpenMP threads per process oversubscribe badly.
THREADS = ["--threads", "1"]


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _invoke(command, args: list[str]):
    result = CliRunner().invoke(command, args, catch_exceptions=False)
    return result


def _rows(result) -> list[dict] | dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _assert_rates_consistent(row: dict, num_requests: int, input_len: int, output_len: int) -> None:
    assert row["elapsed_s"] > 0
    assert row["output_tokens"] == num_requests * output_len
    assert row["input_tokens"] == num_requests * input_len
    assert row["requests_per_s"] == pytest.approx(num_requests / row["elapsed_s"])
    assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["elapsed_s"])
    assert row["total_tokens_per_s"] == pytest.approx((row["input_tokens"] + row["output_tokens"])
                                                      / row["elapsed_s"])


# ---- prompts ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def test_prompts_are_distinct_windows_of_the_eval_text(tokenizer):
    from fp8cache.bench.prompts import PromptSource
    from fp8cache.quality.eval import locate_eval_text, read_text

    text = read_text(locate_eval_text())
    source = PromptSource(tokenizer)
    first, second = source.take(5, 48), source.take(3, 48)
    windows = first + second
    assert all(len(w) == 48 for w in windows)
    # No two share a first block, so the prefix cache cannot serve a measured prefill.
    assert len({tuple(w[:16]) for w in windows}) == len(windows)
    for w in windows:
        assert tokenizer.decode(w) in text


def test_prompts_from_a_short_text_overlap_or_fail_clearly(tokenizer, tmp_path, monkeypatch):
    from fp8cache.bench.prompts import PromptSource

    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"item{i}" for i in range(150)))
    monkeypatch.setenv("FP8KV_EVAL_TEXT", str(short))
    total = len(tokenizer(short.read_text(), add_special_tokens=False)["input_ids"])
    count = total // 40 + 3  # more windows than fit side by side
    windows = PromptSource(tokenizer).take(count, 40)
    assert len({tuple(w) for w in windows}) == count and all(len(w) == 40 for w in windows)
    with pytest.raises(ValueError, match="too few"):
        PromptSource(tokenizer).take(10_000, 100)
    monkeypatch.setenv("FP8KV_EVAL_TEXT", str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="FP8KV_EVAL_TEXT"):
        PromptSource(tokenizer)


# ---- throughput -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def throughput_run(default_model_path, tmp_path_factory):
    plot = tmp_path_factory.mktemp("plots") / "throughput.png"
    args = [default_model_path, *SMALL, *THREADS, "--kv-cache-dtype", "auto", "--kv-cache-dtype", "fp8_e4m3",
            "--compare", "hf", "--kv-cache-memory", "32MiB", "--repeats", "2", "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    return _rows(_invoke(bench_commands.throughput, args)), plot


@pytest.mark.slow
def test_throughput_rows_add_up(throughput_run):
    rows, _ = throughput_run
    assert [(r["engine"], r["kv_cache_dtype"]) for r in rows] == [
        ("fp8kv", "auto"), ("fp8kv", "fp8_e4m3"), ("transformers", "auto")]
    for r in rows:
        assert (r["num_prompts"], r["input_len"], r["output_len"]) == (4, 32, 8)
        _assert_rates_consistent(r, 4, 32, 8)
        assert r["repeats"] == 2 and r["elapsed_s"] == min(r["elapsed_all_s"])  # median of two: the lower
        assert r["machine"]["threads"] == 1
        assert r["dtype"] == "float32"  # --dtype auto on CPU, and the peer the same (--peer-dtype same)
    for r in rows[:2]:
        assert r["finish_reasons"] == {"length": 4} and r["num_preemptions"] == 0
        assert r["vs_transformers"] == pytest.approx(r["output_tokens_per_s"] / rows[2]["output_tokens_per_s"])
        assert r["vs_auto"] == pytest.approx(r["output_tokens_per_s"] / rows[0]["output_tokens_per_s"])


@pytest.mark.slow
def test_throughput_peer_may_run_another_model_dtype(default_model_path):
    rows = _rows(_invoke(bench_commands.throughput, [
        default_model_path, *SMALL, *THREADS, "--kv-cache-dtype", "fp8_e4m3", "--dtype", "bfloat16",
        "--compare", "hf", "--peer-dtype", "float32", "--kv-cache-memory", "32MiB", "--kv-recent-window-sinks", "0",
        "--json"]))
    assert [(r["engine"], r["dtype"]) for r in rows] == [("fp8kv", "bfloat16"), ("transformers", "float32")]
    assert (rows[0]["kv_recent_window"], rows[0]["kv_recent_window_sinks"]) == (32, 0)
    _assert_rates_consistent(rows[1], 4, 32, 8)
    assert rows[0]["vs_transformers"] == pytest.approx(rows[0]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"])


@pytest.mark.slow
def test_throughput_cache_sizes_follow_the_model_config(throughput_run, default_model_path):
    from transformers import AutoConfig

    rows, _ = throughput_run
    cfg = AutoConfig.from_pretrained(default_model_path)
    per_element = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert rows[0]["bytes_per_token"] == per_element * torch.finfo(torch.float32).bits // 8
    assert rows[1]["bytes_per_token"] == per_element * torch.finfo(torch.float8_e4m3fn).bits // 8
    assert rows[0]["window_bytes"] == 0 and (rows[1]["kv_recent_window"], rows[1]["kv_recent_window_sinks"]) == (32, 1)
    # a float32 ring of 32 tokens and 1 attention sink: 3 blocks of 16
    assert rows[1]["window_bytes"] == rows[1]["window_seats"] * 48 * rows[0]["bytes_per_token"]
    for r in rows[:2]:  # every dtype gets the same 32MiB (less the window's), in whole blocks of 16 tokens
        assert r["capacity_tokens"] == (32 * 2**20 - r["window_bytes"]) // (16 * r["bytes_per_token"]) * 16


@pytest.mark.slow
def test_throughput_plot_is_a_png(throughput_run):
    _, plot = throughput_run
    if plot is None:
        pytest.skip("matplotlib is not installed")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_throughput_compares_recent_windows_side_by_side(default_model_path):
    """--kv-recent-window 0,32: each FP8 dtype runs once per window (auto once), windowed rows over window 0."""
    args = [default_model_path, *SMALL, *THREADS, "--kv-cache-dtype", "auto,fp8_e4m3", "--kv-recent-window", "0,32",
            "--kv-cache-memory", "32MiB", "--json"]
    rows = _rows(_invoke(bench_commands.throughput, args))
    assert [(r["variant"], r["kv_cache_dtype"], r["kv_recent_window"]) for r in rows] == [
        ("auto", "auto", 0), ("fp8_e4m3 w0", "fp8_e4m3", 0), ("fp8_e4m3 w32", "fp8_e4m3", 32)]
    for r in rows:
        _assert_rates_consistent(r, 4, 32, 8)
    assert rows[1]["window_bytes"] == 0 and rows[2]["window_bytes"] > 0
    assert rows[2]["capacity_tokens"] < rows[1]["capacity_tokens"]  # the window's memory comes out of the budget
    assert "vs_window0" not in rows[1]
    assert rows[2]["vs_window0"] == pytest.approx(rows[2]["output_tokens_per_s"] / rows[1]["output_tokens_per_s"])


@pytest.mark.parametrize("rotation,resolved", [("auto", "hadamard"), ("none", "none")])
def test_throughput_runs_the_kv_scales_and_rotation_asked_for(tiny_llama_path, monkeypatch, rotation, resolved):
    """--kv-scales / --kv-rotation reach the engines' config: their caches hold dynamic scales, rotated as asked
    (auto: the Hadamard rotation, which head size 64 allows)."""
    from fp8cache.bench import throughput

    built = []

    def recording_build_engines(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    real = throughput.build_engines
    monkeypatch.setattr(throughput, "build_engines", recording_build_engines)
    args = [tiny_llama_path, "--num-prompts", "1", "--input-len", "8", "--output-len", "2", *THREADS,
            "--kv-cache-dtype", "fp8_e4m3", "--kv-cache-memory", "8MiB", "--device", "cpu", "--json",
            "--kv-scales", "dynamic", "--kv-rotation", rotation]
    rows = _rows(_invoke(bench_commands.throughput, args))
    assert [r["kv_cache_dtype"] for r in rows] == ["fp8_e4m3"]
    spec = built[0]["fp8_e4m3"].runner.kv_spec
    assert (spec.dynamic_scales, spec.rotation) == (True, resolved)


@pytest.mark.slow
def test_throughput_runs_a_lower_cpu_path_on_request(default_model_path):
    """--cpu-isa avx2: the engines run the op library built for AVX2 CPUs (Zen 2/3, Haswell to Cascade Lake),
    and the fp8kv rows say so. In its own process: a process holds one op library."""
    if "avx2" not in cpu_info.cpu_feature_names():
        pytest.skip("this CPU has no AVX2")
    args = ["bench", "throughput", default_model_path, *SMALL, *THREADS, "--kv-cache-dtype", "fp8_e4m3",
            "--kv-cache-memory", "32MiB", "--device", "cpu", "--cpu-isa", "avx2", "--json"]
    done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [(r["engine"], r["cpu_path"]) for r in rows] == [("fp8kv", "avx2")]
    _assert_rates_consistent(rows[0], 4, 32, 8)


def test_throughput_keeps_a_lower_cpu_path_to_one_process(default_model_path):
    result = CliRunner().invoke(bench_commands.throughput, [default_model_path, "--device", "cpu", "--cpu-isa", "avx2",
                                                            "--num-shard", "2"])
    assert result.exit_code != 0 and "--cpu-isa" in result.output and "--num-shard" in result.output


def test_throughput_refuses_a_bad_window_list(default_model_path):
    result = CliRunner().invoke(bench_commands.throughput, [default_model_path, "--kv-recent-window", "0,-1"])
    assert result.exit_code != 0 and "--kv-recent-window" in result.output and ">= 0" in result.output


def test_generation_matches_transformers_greedy(default_model_path, default_model, tokenizer):
    """The bench's engine run and its peer run generate the same tokens (both greedy, float32)."""
    from fp8cache import LLM
    from fp8cache.bench import throughput
    from fp8cache.bench.prompts import PromptSource

    prompts = PromptSource(tokenizer).take(2, 16)
    llm = LLM(model=default_model_path, kv_cache_memory="16MiB", log=lambda m: None)
    ours = llm.generate(prompts, throughput.bench_params(4))
    model = default_model
    result = throughput.run_transformers(model, prompts, 4, tokenizer.eos_token_id)
    assert result.output_tokens == 2 * 4
    with torch.inference_mode():
        peer = model.generate(torch.tensor(prompts), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
    assert [o.outputs[0].token_ids for o in ours] == peer[:, 16:].tolist()


# ---- capacity ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_capacity_batches_fit_the_budget_without_preemption(default_model_path, tmp_path):
    # 3 MB holds 4 blocks of 16 tokens in float32 (1 sequence of 64) and 16 in FP8 (4 sequences).
    plot = tmp_path / "capacity.png"
    args = [default_model_path, "--kv-cache-memory", "3MB", "--context", "64", "--output-len", "4",
            "--kv-cache-dtype", "auto,fp8_e4m3", "--kv-recent-window", "0", "--repeats", "2", *THREADS, "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    rows = _rows(_invoke(bench_commands.capacity, args))
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8_e4m3"]
    for r in rows:
        block_bytes = r["bytes_per_token"] * r["block_size"]
        assert r["num_blocks"] == 3_000_000 // block_bytes
        assert r["capacity_tokens"] == r["num_blocks"] * r["block_size"]
        assert r["max_batch"] == r["num_blocks"] // math.ceil(64 / r["block_size"]) == r["batch"]
        assert r["num_preemptions"] == 0 and r["verified"] is True
        assert r["repeats"] == 2 and r["elapsed_s"] == min(r["elapsed_all_s"])
        assert 1 <= r["peak_running"] <= r["batch"]
        _assert_rates_consistent(r, r["batch"], 60, 4)
    assert (rows[0]["max_batch"], rows[1]["max_batch"]) == (1, 4)
    assert rows[1]["vs_auto"] == pytest.approx(rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"])
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_rejects_a_context_without_room_for_a_prompt(default_model_path):
    from fp8cache.bench import capacity

    with pytest.raises(ValueError, match="--output-len"):
        next(capacity.iter_capacity(default_model_path, contexts=(8,), output_len=8))


# ---- serve against a fake server --------------------------------------------------------------------

# The fake server answers requests in arrival order with these behaviours, cycling.
FAKE_MODES = ("ok", "http500", "ok", "cut", "ok", "error_event", "ok", "no_done")
FAKE_PROMPT_TOKENS = 7


def _fake_app(state: dict):
    app = FastAPI()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        mode = FAKE_MODES[state["count"] % len(FAKE_MODES)]
        state["count"] += 1
        state["bodies"].append(body)
        if mode == "http500":
            return JSONResponse({"error": {"message": "fake failure", "type": "server_error"}}, status_code=500)

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0.005)
                    if i == 1 and mode == "cut":
                        raise RuntimeError("fake server drops the connection")
                    if i == 1 and mode == "error_event":
                        yield sse({"error": {"message": "fake engine died", "code": 500}})
                        return
                    yield sse({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
                if mode == "no_done":
                    return
                usage = {"prompt_tokens": FAKE_PROMPT_TOKENS, "completion_tokens": body["max_tokens"]}
                yield sse({"choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = {"count": 0, "in_flight": 0, "max_in_flight": 0, "bodies": []}
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


def _reset(state: dict) -> None:
    state.update(count=0, in_flight=0, max_in_flight=0, bodies=[])


def test_serve_counts_failures_and_measures_the_rest(fake_server):
    from fp8cache.bench import serve

    url, state = fake_server
    _reset(state)
    n, out_len = 16, 5
    bench = serve.ServeBench(url, "fake-model", [f"prompt {i}" for i in range(n)], [3] * n, out_len,
                             request_rate=200.0, max_concurrency=3, seed=1)
    results = asyncio.run(bench.run())
    summary = serve.summarize(results, bench.duration_s)
    ok_expected = sum(FAKE_MODES[i % len(FAKE_MODES)] == "ok" for i in range(n))
    assert summary["completed"] == ok_expected and summary["failed"] == n - ok_expected
    assert sum(summary["errors"].values()) == n - ok_expected
    assert any(e.startswith("HTTP 500") for e in summary["errors"])
    assert any("[DONE]" in e for e in summary["errors"])
    assert any(e.startswith("error in stream") for e in summary["errors"])
    assert state["max_in_flight"] <= 3
    assert summary["output_tokens"] == ok_expected * out_len  # the server's usage counts
    assert summary["input_tokens"] == ok_expected * FAKE_PROMPT_TOKENS
    assert summary["output_tokens_per_s"] == pytest.approx(summary["output_tokens"] / bench.duration_s)
    assert summary["request_throughput"] == pytest.approx(ok_expected / bench.duration_s)
    ok = [r for r in results if r.ok]
    assert all(len(r.itl_s) == out_len - 1 for r in ok)
    for r in ok:
        assert 0 < r.ttft_s <= r.latency_s
        assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / (out_len - 1))
        assert r.ttft_s + sum(r.itl_s) <= r.latency_s + 1e-9
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"]
    assert summary["e2el_ms"]["median"] >= summary["ttft_ms"]["median"]
    body = state["bodies"][0]
    assert body["stream"] is True and body["max_tokens"] == out_len and body["ignore_eos"] is True


def test_serve_arrivals_are_seeded_poisson(fake_server):
    from fp8cache.bench import serve

    url, state = fake_server

    def make(rate: float, seed: int) -> serve.ServeBench:
        return serve.ServeBench(url, "m", ["p"] * 4000, [1] * 4000, 1, rate, seed=seed)

    gaps = make(20.0, 3).arrival_gaps()
    assert gaps == make(20.0, 3).arrival_gaps() and gaps != make(20.0, 4).arrival_gaps()
    assert gaps[0] == 0 and sum(gaps[1:]) / len(gaps[1:]) == pytest.approx(1 / 20.0, rel=0.1)
    assert make(math.inf, 3).arrival_gaps() == [0.0] * 4000
    # Requests go out no earlier than their arrival times.
    _reset(state)
    bench = serve.ServeBench(url, "m", ["p"] * 6, [1] * 6, 2, request_rate=50.0, seed=5)
    results = asyncio.run(bench.run())
    arrivals = [sum(bench.arrival_gaps()[:i + 1]) for i in range(6)]
    assert all(r.start_s >= a - 1e-3 for r, a in zip(sorted(results, key=lambda r: r.start_s), arrivals))


def test_serve_survives_a_server_that_is_not_there():
    from fp8cache.bench import serve

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bench = serve.ServeBench(f"http://127.0.0.1:{port}", "m", ["a", "b", "c"], [1] * 3, 4)
    summary = serve.summarize(asyncio.run(bench.run()), bench.duration_s)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["ttft_ms"]["median"] is None and summary["output_tokens_per_s"] == 0
    with pytest.raises(ConnectionError, match="--model"):
        serve.fetch_model_name(f"http://127.0.0.1:{port}")


def test_serve_command_prints_json_and_plot(fake_server, default_model_path, tmp_path):
    url, state = fake_server
    _reset(state)
    args = ["--url", url, "--tokenizer", default_model_path, "--num-prompts", "8", "--input-len", "16",
            "--output-len", "4", "--request-rate", "inf", "--max-concurrency", "4", "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(tmp_path / "serve.png")]
    except ImportError:
        pass
    summary = _rows(_invoke(bench_commands.serve, args))
    assert summary["model"] == "fake-model"  # looked up at /v1/models
    assert summary["completed"] + summary["failed"] == 8 and summary["failed"] == 4
    assert summary["output_tokens"] == 4 * summary["completed"]
    assert len(state["bodies"]) == 8 and all(isinstance(b["prompt"], str) for b in state["bodies"])


# ---- the real server --------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_against_fp8kv_run(default_model_path, tmp_path):
    from server_process import ServerProcess  # tests/ is on sys.path: its conftest.py puts it there

    # Registers `run` on the CLI in case the lead has not yet (adding it twice is harmless).
    prelude = "from launcher.cli import main\nfrom launcher.run import run\nmain.add_command(run)"
    proc = ServerProcess([default_model_path, "--kv-cache-dtype", "fp8", "--kv-cache-memory", "16MiB",
                          "--max-model-len", "128"], str(tmp_path / "server.log"), python_prelude=prelude)
    try:
        args = ["--url", proc.url, "--tokenizer", default_model_path, "--num-prompts", "4", "--input-len", "24",
                "--output-len", "6", "--request-rate", "inf", "--json"]
        summary = _rows(_invoke(bench_commands.serve, args))
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]
    assert summary["failed"] == 0, summary["errors"]
    assert summary["completed"] == 4 and summary["output_tokens"] == 4 * 6  # ignore_eos, the server's usage
    assert summary["itl_ms"]["median"] > 0 and summary["tpot_ms"]["median"] > 0


# ---- the command line -------------------------------------------------------------------------------


def test_bad_flags_fail_before_loading_anything():
    result = CliRunner().invoke(bench_commands.throughput, ["--kv-cache-dtype", "auto,fp9"])
    assert result.exit_code == 2 and "fp8_e4m3" in result.output and "fp9" in result.output
    result = CliRunner().invoke(bench_commands.throughput, ["--compare", "hf", "--peer-dtype", "float16"])
    assert result.exit_code == 2 and "--peer-dtype" in result.output
    result = CliRunner().invoke(bench_commands.capacity, ["--context", "4k"])
    assert result.exit_code == 2 and "--context" in result.output
    result = CliRunner().invoke(bench_commands.serve, ["--request-rate", "0"])
    assert result.exit_code == 2 and "--request-rate" in result.output


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = CliRunner().invoke(bench_commands.throughput, ["--plot", "x.png"])
    assert result.exit_code == 2 and "pip install fp8kv[plot]" in result.output


def test_ctrl_c_prints_the_rows_measured_so_far(monkeypatch):
    from fp8cache.bench import throughput

    row = {"engine": "fp8kv", "kv_cache_dtype": "auto", "dtype": "float32", "output_tokens_per_s": 5.0, "requests_per_s": 1.0,
           "total_tokens_per_s": 9.0, "elapsed_s": 2.0, "machine": {"cpu": "x", "threads": 1, "torch": "t"}}

    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args)
        yield dict(row)
        raise KeyboardInterrupt

    monkeypatch.setattr(throughput, "iter_throughput", interrupted)
    result = CliRunner().invoke(bench_commands.throughput, ["--json", "--device", "cpu", "--kv-cache-dtype", "auto",
                                                            "--kv-cache-dtype", "fp8,fp8_e5m2,auto"])
    assert result.exit_code == bench_commands.EXIT_INTERRUPTED
    assert calls[0][1] == ("auto", "fp8_e4m3", "fp8_e5m2")  # repeated and comma lists, fp8 resolved
    assert json.loads(result.stdout) == [dict(row, vs_auto=1.0, cpu_path=torch.ops.fp8kv.cpu_isa())]
    result = CliRunner().invoke(bench_commands.throughput, ["--device", "cpu"])
    assert result.exit_code == bench_commands.EXIT_INTERRUPTED and "5.0" in result.stdout


# ---- bench kernels ----------------------------------------------------------------------------------

def test_interleaved_ms_takes_turns_and_reports_each_ones_median(monkeypatch):
    from fp8cache.bench import machine

    clock, calls = [0.0], []
    monkeypatch.setattr(machine.time, "perf_counter", lambda: clock[0])

    def fn(name: str, seconds: list[float]):
        def run() -> None:
            calls.append(name)
            clock[0] += seconds.pop(0) if seconds else 0.0
        return run

    # After one warm-up call each, rounds of (a, b): a takes 1, 5, 2 ms and b 3, 3, 9 ms.
    a, b = fn("a", [0.1, 0.001, 0.005, 0.002]), fn("b", [0.1, 0.003, 0.003, 0.009])
    assert machine.interleaved_ms([a, b], warmup=1, repeats=3) == pytest.approx([2.0, 3.0])
    assert calls == ["a", "b"] * 4


def test_interleaved_ms_settles_each_fn_before_timing_it(monkeypatch):
    from fp8cache.bench import machine

    clock, calls = [0.0], []
    monkeypatch.setattr(machine.time, "perf_counter", lambda: clock[0])

    def fn(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            clock[0] += seconds
        return run

    # a takes 1 ms a call, b 4 ms: 2.5 ms of settling is three untimed calls of a, one of b.
    a, b = fn("a", 0.001), fn("b", 0.004)
    assert machine.interleaved_ms([a, b], warmup=0, repeats=2, settle_ms=2.5) == pytest.approx([1.0, 4.0])
    assert calls == (["a"] * 4 + ["b"] * 2) * 2
    calls.clear()  # twins settle instead, so the timed call's data is not left warm in the caches
    twin_a, twin_b = fn("twin a", 0.001), fn("twin b", 0.004)
    assert machine.interleaved_ms([a, b], warmup=0, repeats=1, settle_ms=2.5,
                                  settle_fns=[twin_a, twin_b]) == pytest.approx([1.0, 4.0])
    assert calls == ["twin a"] * 3 + ["a", "twin b", "b"]


@pytest.mark.parametrize("settle_ms", ["0", "2"])
def test_bench_kernels_rows_cover_every_case_and_add_up(settle_ms):
    from launcher.cli import main

    args = ["bench", "kernels", "--shapes", "1x48,2x40", "--num-heads", "4", "--num-kv-heads", "2",
            "--head-size", "64", "--repeats", "1", "--settle-ms", settle_ms, "--json"]
    rows = _rows(_invoke(main, args))
    cases = {(r["impl"], r["kv_cache_dtype"], r["dtype"]) for r in rows}
    assert cases == {("fp8kv", "fp8_e4m3", "bfloat16"), ("fp8kv", "fp8_e5m2", "bfloat16"),
                     ("fp8kv", "fp8_e4m3fnuz", "bfloat16"), ("fp8kv", "auto", "bfloat16"),
                     ("fp8kv", "auto", "float32"), ("torch_sdpa", "auto", "float32")}
    assert len(rows) == 2 * len(cases) and {(r["batch"], r["context"]) for r in rows} == {(1, 48), (2, 40)}
    for r in rows:
        assert (r["num_heads"], r["num_kv_heads"], r["head_size"]) == (4, 2, 64)
        assert r["cpu_path"] == torch.ops.fp8kv.cpu_isa()  # what this process loaded
        assert r["ms"] > 0 and r["read_bw_gbps"] > 0
        fp8 = r["kv_cache_dtype"].startswith("fp8")
        element = 1 if fp8 else torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
        kv_bytes = 2 * r["batch"] * r["context"] * r["num_kv_heads"] * r["head_size"] * element
        assert r["kv_gbps"] == pytest.approx(kv_bytes / r["ms"] / 1e6)


def test_bench_kernels_measures_several_attention_shapes_in_one_run():
    """--heads: each model's heads / KV heads / head size at every --shapes pair, one bandwidth probe for all."""
    from launcher.cli import main

    args = ["bench", "kernels", "--shapes", "1x48,2x32", "--heads", "4/2/64,6/3/32", "--repeats", "1",
            "--settle-ms", "0", "--device", "cpu", "--json"]
    rows = _rows(_invoke(main, args))
    assert len(rows) == 2 * 2 * 6
    assert {(r["num_heads"], r["num_kv_heads"], r["head_size"], r["batch"], r["context"]) for r in rows} == {
        (h, kv, d, b, c) for h, kv, d in ((4, 2, 64), (6, 3, 32)) for b, c in ((1, 48), (2, 32))}
    for r in rows:
        element = 1 if r["kv_cache_dtype"].startswith("fp8") else torch.empty((), dtype=getattr(
            torch, r["dtype"])).element_size()
        kv_bytes = 2 * r["batch"] * r["context"] * r["num_kv_heads"] * r["head_size"] * element
        assert r["kv_gbps"] == pytest.approx(kv_bytes / r["ms"] / 1e6)
    for bad in ("4/3/64", "4x2", "0/1/64"):
        result = CliRunner().invoke(main, ["bench", "kernels", "--heads", bad, "--device", "cpu"])
        assert result.exit_code != 0 and "--heads" in result.output and "32/8/128" in result.output


@pytest.mark.slow
def test_bench_kernels_measures_the_portable_path_on_request():
    """--cpu-isa scalar: the kernels Arm machines run, built for this CPU beside the native ones; every row says
    which path ran. In its own process: a process holds one op library."""
    args = ["bench", "kernels", "--cpu-isa", "scalar", "--device", "cpu", "--shapes", "1x40", "--num-heads", "4",
            "--num-kv-heads", "2", "--head-size", "64", "--repeats", "1", "--settle-ms", "0", "--json"]
    done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert rows and {r["cpu_path"] for r in rows if r["impl"] == "fp8kv"} == {"scalar"}
    assert "CPU path scalar" in done.stderr


def test_bench_kernels_refuses_a_cpu_path_this_process_cannot_load():
    from launcher.cli import main

    fp8cache_ops.load("cpu")
    result = CliRunner().invoke(main, ["bench", "kernels", "--cpu-isa", "scalar", "--device", "cpu",
                                       "--shapes", "1x16"])
    assert result.exit_code != 0 and "--cpu-isa" in result.output and "new process" in result.output


def test_bench_kernels_refuses_a_bad_shape_and_heads():
    from launcher.cli import main

    result = CliRunner().invoke(main, ["bench", "kernels", "--shapes", "8by512"])
    assert result.exit_code != 0 and "--shapes" in result.output and "8x8192" in result.output
    result = CliRunner().invoke(main, ["bench", "kernels", "--num-heads", "6", "--num-kv-heads", "4"])
    assert result.exit_code != 0 and "--num-kv-heads" in result.output
    result = CliRunner().invoke(main, ["bench", "kernels", "--settle-ms", "-1"])
    assert result.exit_code != 0 and "--settle-ms" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_kernels_on_cuda_without_a_gpu_names_the_fix():
    from launcher.cli import main

    result = CliRunner().invoke(main, ["bench", "kernels", "--device", "cuda", "--shapes", "1x16"])
    assert result.exit_code != 0 and "--device" in result.output and "use --device cpu" in result.output
