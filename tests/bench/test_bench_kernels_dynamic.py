"""`fp8kv bench kernels --kv-scales both --cache-write`: each FP8 case with static and dynamic scales side by side,
and their cache writes, with the bytes each row counts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner


def test_bench_kernels_measures_dynamic_scales_and_the_cache_write_beside_static():
    from launcher.cli import main

    args = ["bench", "kernels", "--shapes", "2x40", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "64",
            "--repeats", "1", "--settle-ms", "0", "--device", "cpu", "--kv-scales", "both", "--cache-write", "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    fp8 = {"fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"}
    for op in ("attention", "cache_write"):
        got = {(r["kv_cache_dtype"], r["kv_scales"]) for r in rows if r["op"] == op and r["kv_cache_dtype"] in fp8}
        assert got == {(name, kind) for name in fp8 for kind in ("static", "dynamic")}
    for r in rows:
        tokens_heads = r["batch"] * r["context"] * r["num_kv_heads"]
        if r["op"] == "cache_write":  # K and V read in the model dtype (bfloat16)
            want = 2 * tokens_heads * r["head_size"] * 2
        elif r["kv_cache_dtype"] in fp8:  # codes, plus a bfloat16 scale per token and head of K and V
            want = 2 * tokens_heads * (r["head_size"] + 2 * (r["kv_scales"] == "dynamic"))
        else:
            continue
        assert r["kv_gbps"] == pytest.approx(want / r["ms"] / 1e6)
