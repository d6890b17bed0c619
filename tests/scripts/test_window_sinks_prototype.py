"""scripts/window_sinks_prototype.py's dense attention, whose KL figures stood in for the sinks before the cache had
them: with S sinks it must be what the cache computes with kv_recent_window_sinks S (a one-layer model's one prefill
through the real FP8 cache with dynamic scales, the Hadamard rotation and the recent window), and with sinks covering
the text the auto cache."""

from __future__ import annotations

import pytest
import torch
from script_module import load_script

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats
from fp8cache.model import attention
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.quality.eval import runner_batch


@pytest.fixture(scope="module")
def one_layer(make_tiny_model):
    return load_model(EngineConfig(model=make_tiny_model(num_hidden_layers=1)), progress=False)


def logits(loaded, ids: list[int], kv_cache_dtype: str, window: int, attend=None, sinks: int = 0) -> torch.Tensor:
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype, kv_scales="dynamic",
                          kv_rotation="hadamard", kv_recent_window=window, block_size=16, kv_cache_memory="16MiB",
                          max_num_seqs=1, kv_recent_window_sinks=sinks)
    runner = ModelRunner(config, log=lambda _: None, loaded=loaded)
    with pytest.MonkeyPatch.context() as patch:
        if attend is not None:
            patch.setattr(attention, "attend", attend)
        return runner.execute(runner_batch(ids, runner), all_logits=True)


@pytest.mark.parametrize("kv_cache_dtype,window", [("fp8_e4m3", 8), ("fp8_e5m2", 0)])
def test_no_sinks_is_the_cache_and_sinks_over_the_text_are_auto(one_layer, kv_cache_dtype, window):
    script = load_script("window_sinks_prototype.py")
    ids = torch.randint(3, 60, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    fmt = formats.get_format(kv_cache_dtype, "cpu")
    cache = logits(one_layer, ids, kv_cache_dtype, window)
    prototype = logits(one_layer, ids, "auto", 0, script.dense_attention(fmt, window, 0, "kv"))
    torch.testing.assert_close(prototype, cache, atol=3e-5, rtol=1e-5)
    if window:  # the sinks as built: beside a window only
        cache_sinks = logits(one_layer, ids, kv_cache_dtype, window, sinks=3)
        prototype_sinks = logits(one_layer, ids, "auto", 0, script.dense_attention(fmt, window, 3, "kv"))
        torch.testing.assert_close(prototype_sinks, cache_sinks, atol=3e-5, rtol=1e-5)
    auto = logits(one_layer, ids, "auto", 0)
    all_sinks = logits(one_layer, ids, "auto", 0, script.dense_attention(fmt, window, len(ids), "kv"))
    torch.testing.assert_close(all_sinks, auto, atol=3e-5, rtol=1e-5)
    one_sink = logits(one_layer, ids, "auto", 0, script.dense_attention(fmt, window, 1, "kv"))
    assert (one_sink - auto).abs().mean() < (cache - auto).abs().mean()
