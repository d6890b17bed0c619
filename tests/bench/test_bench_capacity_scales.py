"""`fp8kv bench capacity --kv-scales`: the tokens per GiB a cache holds and the share its dynamic scales take, from
the engine's own sizing, checked against the layout worked out by hand (codes: one byte per element of K and V,
every layer and KV head; scales: a bfloat16 per token, KV head and layer for K and for V)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp8cache.bench import capacity
from fp8cache.kvcache.spec import KVCacheSpec
from launcher import bench as bench_commands

BF16_BYTES = torch.tensor([], dtype=torch.bfloat16).element_size()


def by_hand(layers: int, kv_heads: int, head_size: int, element_bytes: int, dynamic: bool) -> tuple[float, float]:
    codes = 2 * layers * kv_heads * head_size * element_bytes
    scales = 2 * layers * kv_heads * BF16_BYTES if dynamic else 0
    return 2**30 / (codes + scales), scales / (codes + scales)


# the default model (d64), Llama-3.1-8B's attention (d128), and an odd one
SHAPES = [(30, 3, 64), (32, 8, 128), (5, 1, 80)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,dynamic", [("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", False),
                                           ("fp8_e5m2", True), ("auto", False)])  # an auto cache has no scales
def test_token_figures_match_the_layout(shape, dtype, dynamic):
    layers, kv_heads, head_size = shape
    spec = KVCacheSpec.build(dtype, torch.bfloat16, 16, layers, kv_heads, head_size, None, dynamic=dynamic)
    figures = capacity.token_figures(spec)
    element = 1 if dtype != "auto" else BF16_BYTES
    tokens, share = by_hand(layers, kv_heads, head_size, element, dynamic)
    assert figures["tokens_per_gib"] == pytest.approx(tokens, rel=1e-12)
    assert figures["scales_share"] == pytest.approx(share, abs=1e-12)
    assert figures["kv_scales"] == ("dynamic" if dynamic else "static" if dtype != "auto" else "none")


def test_dynamic_scales_cost_under_four_percent_at_head_size_64():
    """Issue 54's capacity target: 2 bytes per token and KV head for K and V each over 2 x 64 bytes of codes."""
    static, dynamic = (capacity.token_figures(KVCacheSpec.build("fp8_e4m3", torch.bfloat16, 16, 30, 3, 64, None,
                                                                dynamic=d)) for d in (False, True))
    lost = 1 - dynamic["tokens_per_gib"] / static["tokens_per_gib"]
    assert lost == pytest.approx(dynamic["scales_share"]) == pytest.approx(4 / 132)
    assert lost <= 0.04


def test_cache_variants():
    assert capacity.cache_variants(["auto", "fp8_e4m3"], "both") == {
        "auto": {"kv_cache_dtype": "auto", "kv_scales": "static"},
        "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": "static"},
        "fp8_e4m3 dynamic": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": "dynamic"}}
    assert list(capacity.cache_variants(["fp8_e5m2"], "dynamic")) == ["fp8_e5m2 dynamic"]
    with pytest.raises(ValueError, match="valid: static, dynamic, both"):
        capacity.cache_variants(["fp8_e4m3"], "sometimes")


@pytest.mark.slow
def test_capacity_with_static_and_dynamic_scales(default_model_path):
    # 3 MB: 16 blocks of 16 tokens with static FP8 scales (4 sequences of 64), 15 with dynamic ones (3 sequences)
    args = [default_model_path, "--kv-cache-memory", "3MB", "--context", "64", "--output-len", "4",
            "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", "both", "--kv-recent-window", "0", "--threads", "1",
            "--json"]
    result = CliRunner().invoke(bench_commands.capacity, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("["):])
    assert [(r["variant"], r["kv_cache_dtype"], r["kv_scales"]) for r in rows] == [
        ("fp8_e4m3", "fp8_e4m3", "static"), ("fp8_e4m3 dynamic", "fp8_e4m3", "dynamic")]
    config = json.loads((Path(default_model_path) / "config.json").read_text())
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for r in rows:
        tokens, share = by_hand(layers, kv_heads, head_size, 1, r["kv_scales"] == "dynamic")
        assert r["bytes_per_token"] == 2**30 / tokens
        assert r["tokens_per_gib"] == pytest.approx(tokens) and r["scales_share"] == pytest.approx(share)
        assert r["num_blocks"] == 3_000_000 // (16 * r["bytes_per_token"])
        assert r["max_batch"] == r["num_blocks"] // math.ceil(64 / 16) and r["num_preemptions"] == 0
    assert (rows[0]["max_batch"], rows[1]["max_batch"]) == (4, 3)
