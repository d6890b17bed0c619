"""scripts/gpu_check.sh, the GPU acceptance run, without a GPU: its steps' notes (fp8cache.bench.summary) from
rows whose figures are known, and the script itself on the CPU (DEVICE=cpu) at a tiny scale: every step asked
for runs after the serve step (its RETURN trap used to end the run there), a failed step fails the run without
stopping the next, the server goes away, and each note holds its step's figures.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fp8cache.bench import summary

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 600, "max_position_embeddings": 512, "bos_token_id": 300, "eos_token_id": 301,
        "tie_word_embeddings": False}


def _kernel_row(impl: str, kv: str, dtype: str, us: float, batch: int = 8, context: int = 8192, heads=(32, 8, 128),
                bandwidth: float = 4000.0) -> dict:
    element = 1 if kv.startswith("fp8") else 2
    kv_bytes = 2 * batch * context * heads[1] * heads[2] * element
    return {"impl": impl, "kv_cache_dtype": kv, "dtype": dtype, "batch": batch, "context": context,
            "num_heads": heads[0], "num_kv_heads": heads[1], "head_size": heads[2], "ms": us / 1000,
            "kv_gbps": kv_bytes / (us / 1000) / 1e6, "read_bw_gbps": bandwidth, "bandwidth_probe": "copy"}


def _shape(us: dict, **where) -> list[dict]:
    return [_kernel_row("fp8kv", "fp8_e4m3", "bfloat16", us["e4m3"], **where),
            _kernel_row("fp8kv", "fp8_e5m2", "bfloat16", us["e5m2"], **where),
            _kernel_row("fp8kv", "fp8_e4m3fnuz", "bfloat16", us["fnuz"], **where),
            _kernel_row("fp8kv", "auto", "bfloat16", us["bf16"], **where),
            _kernel_row("torch_sdpa", "auto", "bfloat16", us["sdpa"], **where)]


def test_sweep_note_gives_each_shapes_plan_and_fastest_setting(tmp_path):
    """The sweep step's files (the plan's run, then FP8KV_TC_* settings in the order measured) as one table."""
    big = {"e5m2": 1.0, "fnuz": 1.0, "bf16": 1.0, "sdpa": 1.0}
    runs = {"plan": ({"e4m3": 58.2}, {"e4m3": 13.8}), "STAGES=3": ({"e4m3": 64.7}, {"e4m3": 14.8}),
            "SPLITS=1": ({"e4m3": 120.9}, {"e4m3": 12.9})}
    for setting, (long, short) in runs.items():  # written in this order: the table keeps it
        rows = _shape(big | long) + _shape(big | short, batch=1, context=512)
        path = tmp_path / f"sweep-{setting}.json"
        path.write_text(json.dumps(rows))
        os.utime(path, ns=(len(list(tmp_path.iterdir())) * 10**9,) * 2)
    assert summary.main(["sweep", str(tmp_path)]) == 0
    table = (tmp_path / "sweep.txt").read_text().splitlines()
    assert table[0].split() == ["shape", "plan", "STAGES=3", "SPLITS=1"]
    assert table[1].split() == ["32/8", "d128", "8x8192", "58.2", "64.7", "120.9"]
    assert (tmp_path / "sweep.note").read_text().strip() == (
        "32/8 d128 8x8192: plan 58.2 us, best plan 58.2; 32/8 d128 1x512: plan 13.8 us, best SPLITS=1 12.9")


def test_kernels_note_gives_each_shapes_figures_and_the_targets():
    # 8 x 8192 x 8 KV heads x 128 x K and V = 134 MB of FP8: 40 us is 3355 GB/s, 84% of 4000 GB/s.
    fast = _shape({"e4m3": 40.0, "e5m2": 42.0, "fnuz": 48.0, "bf16": 80.0, "sdpa": 66.7})
    slow = _shape({"e4m3": 118.7, "e5m2": 120.0, "fnuz": 181.1, "bf16": 173.8, "sdpa": 66.7}, batch=32,
                  context=4096, heads=(9, 3, 64))
    short = _shape({"e4m3": 20.6, "e5m2": 21.0, "fnuz": 26.7, "bf16": 24.3, "sdpa": 8.0}, batch=1, context=512)
    table, note = summary.kernels_report(fast + slow + short)
    assert note.startswith("copy 4000 GB/s; 32/8 d128 8x8192: e4m3 40.0 us 84% bw, SDPA 66.7 us = 1.67x e4m3, "
                           "e4m3/bf16 0.50, e5m2 +5%, e4m3fnuz +20%; ")
    assert "9/3 d64 32x4096: e4m3 118.7 us " in note and "SDPA 66.7 us = 0.56x e4m3, e4m3/bf16 0.68" in note
    assert "e4m3fnuz +53%" in note
    # Only 8x8192 and 32x4096 are target shapes here; 1x512 has its own.
    assert note.endswith(">=80% bw 1/2, >=1.6x SDPA 1/2, <=0.55x bf16 1/2, e5m2/fnuz within 10% 0/2, "
                         "1x512 <= 10 us MISSED")
    assert len(table.splitlines()) == 2 + 15 and "copy bandwidth 4000 GB/s" in table


def test_capacity_and_scale_notes_compare_fp8_with_auto():
    base = {"engine": "fp8kv", "kv_cache_memory": "16.5GiB", "context": 4224, "input_len": 4096, "output_len": 128,
            "num_preemptions": 0, "steps": 300, "elapsed_s": 40.0, "prefill_s": 30.0, "decode_s": 9.5,
            "decode_step_ms": 70.0}
    auto = {**base, "kv_cache_dtype": "auto", "max_batch": 32, "batch": 32, "peak_running": 32, "decode_batch": 32.0,
            "output_tokens_per_s": 100.0}
    fp8 = {**base, "kv_cache_dtype": "fp8_e4m3", "max_batch": 64, "batch": 64, "peak_running": 60,
           "decode_batch": 63.5, "output_tokens_per_s": 140.0}
    _, note = summary.capacity_report([auto, fp8])
    assert note.startswith("context 4224 (4096 in + 128 out), KV 16.5GiB: auto 32 seqs fit, ran 32, 100 tok/s, "
                           "0 preemptions, decode step 70.00 ms at batch 32.0 (peak 32), prefill 30.00 s / decode "
                           "9.50 s of 40.00 s; fp8_e4m3 64 seqs fit")
    assert note.endswith("fp8_e4m3/auto 2.00x seqs (>= 1.9x met), 1.40x tok/s (>= 1.5x MISSED)")
    rows = [{**auto, "variant": "auto"}, {**fp8, "variant": "fp8_e4m3"}]
    _, note = summary.throughput_report(rows, scale=True)
    assert note.endswith("fp8_e4m3 targets: 1.88x auto's peak sequences (>= 1.9x MISSED), "
                         "1.40x auto's tok/s (>= 1.5x MISSED)")


def test_throughput_note_states_the_end_to_end_targets():
    rows = [{"engine": "fp8kv", "kv_cache_dtype": "auto", "variant": "auto", "output_tokens_per_s": 10855.0,
             "elapsed_s": 1.0},
            {"engine": "fp8kv", "kv_cache_dtype": "fp8_e4m3", "variant": "fp8_e4m3", "output_tokens_per_s": 11456.0,
             "elapsed_s": 1.0},
            {"engine": "transformers", "kv_cache_dtype": "auto", "output_tokens_per_s": 1223.0, "elapsed_s": 1.0}]
    _, note = summary.throughput_report(rows)
    assert note == ("auto 10855 tok/s (8.88x transformers); fp8_e4m3 11456 tok/s (9.37x transformers, 1.06x auto); "
                    "transformers 1223 tok/s; fp8_e4m3 targets: >= 30000 tok/s MISSED, >= 20x transformers MISSED, "
                    "not slower than auto met")


def test_eval_compares_each_format_on_the_device_and_the_cpu(tmp_path):
    seen = []

    def evaluate(config, windows, window_len, progress):
        seen.append((config.kv_cache_dtype, config.device))
        kl = {"fp8_e4m3": 0.002, "fp8_e5m2": 0.008, "fp8_e4m3fnuz": 0.002}[config.kv_cache_dtype]
        drift = 1.04 if config.device == "cuda" and config.kv_cache_dtype == "fp8_e5m2" else 1.0
        return {"kl": kl * drift, "ppl": 20.0}

    _, note, ok = summary.eval_devices(None, "cuda", tmp_path, evaluate=evaluate)
    assert seen[:3] == [("fp8_e4m3", "cuda"), ("fp8_e5m2", "cuda"), ("fp8_e4m3fnuz", "cuda")]  # the GPU's first
    assert ok and "fp8_e5m2 KL cuda 0.00832 cpu 0.00800 (4.0%)" in note and note.endswith("(tolerance 5%: met)")
    assert json.loads((tmp_path / "eval-fp8_e5m2-cpu.json").read_text())["kl"] == 0.008
    _, note, ok = summary.eval_devices(None, "cuda", tmp_path, evaluate=lambda config, **kw: {
        "kl": 0.003 if config.device == "cuda" else 0.002, "ppl": 20.0})
    assert not ok and note.endswith("worst 50.0% (tolerance 5%: MISSED)")


# ---- the script on the CPU --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, model: str, *steps: str) -> subprocess.CompletedProcess:
    config = tmp_path / "tiny"
    config.mkdir(exist_ok=True)
    (config / "config.json").write_text(json.dumps(TINY))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "DEVICE": "cpu",
           "FP8KV_CACHE_DIR": str(Path(os.environ.get("FP8KV_CACHE_DIR") or Path.home() / ".cache" / "fp8kv")),
           "MODEL": model or str(config), "LOAD_FORMAT": "dummy", "SERVE_PORT": str(_free_port()),
           "CAPACITY_MODEL": str(config), "OMP_NUM_THREADS": "1",
           "CAPACITY_ARGS": "--kv-cache-memory 1MiB --context 128 --output-len 8 --dtype float32 --threads 1",
           "KERNEL_ARGS": "--heads 4/2/64,6/2/32 --shapes 1x64 --repeats 1 --settle-ms 0",
           "DYNAMIC_KERNEL_ARGS": "--heads 4/2/64 --shapes 1x64 --repeats 1 --settle-ms 0"}
    return subprocess.run(["bash", str(SCRIPT), *steps], env=env, capture_output=True, text=True, timeout=900,
                          check=False)


def _summary_rows(out: Path) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (out / "summary.txt").read_text().splitlines():
        name, result, _secs, rest = re.match(r"(\S+) +(\S+) +(\d+)s  (.*)", line).groups()
        rows[name] = (result, rest.rstrip())  # a note ends in its newline, made a space
    return rows


@pytest.mark.slow
def test_every_step_after_serve_runs_and_notes_its_figures(tmp_path):
    done = _run(tmp_path, "", "serve", "kernels", "capacity")
    out = tmp_path / "out"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "unbound variable" not in done.stdout + done.stderr
    rows = _summary_rows(out)
    assert {name: result for name, (result, _) in rows.items()} == {"serve": "ok", "kernels": "ok", "capacity": "ok"}
    # Random weights: the stream must complete, not repeat the answer (near-uniform logits flip greedy ties).
    assert re.match(r"up in [0-9.]+ s; chat '.+' in [0-9.]+ s; a stream of \d+ chunks says the same: (True|False)",
                    rows["serve"][1])
    pid = int(re.search(r"Finished server process \[(\d+)\]", (out / "serve-server.log").read_text()).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    kernels = json.loads((out / "kernels.json").read_text())
    assert {(r["num_heads"], r["num_kv_heads"], r["head_size"]) for r in kernels} == {(4, 2, 64), (6, 2, 32)}
    assert rows["kernels"][1] == summary.kernels_report(kernels)[1]
    auto, fp8 = json.loads((out / "capacity.json").read_text())
    note = rows["capacity"][1]
    assert f"auto {auto['max_batch']} seqs fit, ran {auto['batch']}, {auto['output_tokens_per_s']:.0f} tok/s" in note
    assert f"fp8_e4m3 {fp8['max_batch']} seqs fit" in note
    assert f"fp8_e4m3/auto {fp8['max_batch'] / auto['max_batch']:.2f}x seqs" in note


@pytest.mark.slow
def test_a_failed_serve_step_fails_the_run_and_the_next_step_still_runs(tmp_path):
    done = _run(tmp_path, str(tmp_path / "no-such-model"), "serve", "capacity")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "unbound variable" not in done.stdout + done.stderr
    rows = _summary_rows(tmp_path / "out")
    assert rows["serve"][0] == "FAIL" and rows["serve"][1] == f"see {tmp_path / 'out' / 'serve.log'}"
    assert rows["capacity"][0] == "ok" and "seqs fit" in rows["capacity"][1]
