"""KVCacheSpec: the one resolved description of a runner's cache, and what is built from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, sizing
from fp8cache.kvcache.formats import CacheFormat
from fp8cache.kvcache.scales import KVScales
from fp8cache.kvcache.spec import PENDING_SOURCE, KVCacheSpec
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.quality.eval import window_batch

BLOCK = 16
LAYERS, KV_HEADS, HEAD = 2, 2, 64  # conftest.build_tiny_model's shape


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_path):
    return load_model(EngineConfig(model=tiny_llama_path), progress=False)


def make_runner(loaded, kv_cache_dtype: str = "auto", **overrides) -> ModelRunner:
    overrides.setdefault("kv_recent_window", 0)
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                          kv_cache_memory="4MiB", **overrides)
    return ModelRunner(config, log=lambda msg: None, loaded=loaded)


def spec_of(kv_cache_dtype: str, scales: KVScales | None = None, backend: str = "cpu", **fields) -> KVCacheSpec:
    return KVCacheSpec.build(kv_cache_dtype, torch.float32, BLOCK, LAYERS, KV_HEADS, HEAD, scales,
                             backend=backend, **fields)


def check_caches_follow_spec(runner: ModelRunner) -> None:
    spec = runner.kv_spec
    assert len(runner.kv_caches) == spec.num_layers
    for layer, (key_cache, value_cache) in enumerate(runner.kv_caches):
        key_shape, value_shape = spec.cache_shapes(runner.num_blocks, layer)
        assert key_cache.dtype == value_cache.dtype == spec.storage_dtype(layer)
        assert tuple(key_cache.shape) == key_shape and tuple(value_cache.shape) == value_shape
    assert runner.bytes_per_token == sizing.spec_bytes_per_token(spec)
    if spec.window_size:
        ring = runner.cache_plan.window_num_blocks
        key_shape, value_shape = spec.cache_shapes(ring, window=True)
        for key_cache, value_cache in runner.window_caches:
            assert key_cache.dtype == value_cache.dtype == spec.window_dtype
            assert tuple(key_cache.shape) == key_shape and tuple(value_cache.shape) == value_shape
    else:
        assert runner.window_caches is None


def test_auto_spec(tiny_loaded):
    runner = make_runner(tiny_loaded, kv_recent_window=32)  # ignored: an auto cache is full precision
    spec = runner.kv_spec
    assert (spec.kv_cache_dtype, spec.cache_dtype_name, spec.format) == ("auto", "auto", CacheFormat.AUTO)
    assert not spec.is_fp8 and spec.fp8_format is None and not spec.scales_pending
    assert spec.model_dtype == spec.storage_dtype(0) == torch.float32
    assert (spec.block_size, spec.num_layers, spec.num_kv_heads, spec.head_size) == (BLOCK, LAYERS, KV_HEADS, HEAD)
    assert spec.window_size == 0 and spec.rotation == "none" and spec.backend == "cpu"
    assert spec.scales_source == "unused (auto cache)"
    assert spec.fingerprint == runner.cache_fingerprint == "auto:torch.float32"
    check_caches_follow_spec(runner)


def test_fp8_e4m3_spec(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8_e4m3")
    spec = runner.kv_spec
    assert (spec.kv_cache_dtype, spec.cache_dtype_name, spec.format) == ("fp8_e4m3", "fp8_e4m3", CacheFormat.E4M3FN)
    assert spec.storage_dtype(0) == torch.uint8 and spec.model_dtype == torch.float32
    assert spec.fp8_format is formats.FP8_FORMATS["fp8_e4m3"]
    assert spec.scales_source == "default 1.0" and spec.scales is not None
    assert isinstance(spec.k_scales, tuple) and len(spec.k_scales) == len(spec.v_scales) == LAYERS
    assert all(torch.equal(t, torch.ones(1)) for t in spec.k_scales + spec.v_scales)
    check_caches_follow_spec(runner)


def test_fp8_resolves_per_backend(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8")
    assert runner.kv_spec.kv_cache_dtype == "fp8"  # as the user gave it
    assert (runner.kv_spec.cache_dtype_name, runner.kv_spec.format) == ("fp8_e4m3", CacheFormat.E4M3FN)
    check_caches_follow_spec(runner)
    assert spec_of("fp8", backend="cuda").format == CacheFormat.E4M3FN
    rocm = spec_of("fp8", backend="rocm")
    assert (rocm.cache_dtype_name, rocm.format, rocm.backend) == ("fp8_e4m3fnuz", CacheFormat.E4M3FNUZ, "rocm")


def test_per_head_scales_from_a_file(tiny_loaded, per_head_scales):
    k_heads, path = per_head_scales
    runner = make_runner(tiny_loaded, "fp8_e4m3", quantization_param_path=str(path))
    spec = runner.kv_spec
    assert spec.scales_source == f"file {path}" and spec.scales.per_head()
    for layer, heads in enumerate(k_heads):
        assert torch.equal(spec.k_scales[layer], torch.tensor(heads))
        assert spec.k_scales[layer].dtype == torch.float32 and spec.k_scales[layer].is_contiguous()
    assert [t.numel() for t in spec.v_scales] == [1, 1]
    check_caches_follow_spec(runner)


@pytest.mark.parametrize("window,window_dtype", [(0, "auto"), (32, "auto"), (32, "bfloat16")])
def test_recent_window_in_the_spec(tiny_loaded, window, window_dtype):
    runner = make_runner(tiny_loaded, "fp8_e5m2", kv_recent_window=window, kv_recent_window_dtype=window_dtype)
    spec = runner.kv_spec
    assert spec.window_size == window and runner.cache_plan.window_size == window
    assert spec.window_dtype == (torch.float32 if window_dtype == "auto" else torch.bfloat16)
    check_caches_follow_spec(runner)


def test_spec_is_frozen(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8_e4m3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        runner.kv_spec.window_size = 8
    with pytest.raises(AttributeError):  # the runner's old attributes are views of the spec
        runner.cache_dtype_name = "auto"


def test_runner_attributes_read_the_spec(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8", kv_recent_window=32)
    spec = runner.kv_spec
    assert runner.cache_dtype_name == spec.cache_dtype_name == "fp8_e4m3"
    assert runner.kv_recent_window == spec.window_size == 32 and runner.window_dtype == spec.window_dtype
    assert runner.scales is spec.scales and runner.scales_source == spec.scales_source
    assert runner.kv_rotation == spec.rotation == "none"
    assert all(a is b for a, b in zip(runner._k_scales + runner._v_scales, spec.k_scales + spec.v_scales))


def test_spec_checks_its_scales():
    wrong = KVScales([torch.ones(3)] * LAYERS, [torch.ones(1)] * LAYERS, "fp8_e4m3", "file bad.json")
    with pytest.raises(ValueError, match="k scale of layer 0 from file bad.json has 3 values"):
        spec_of("fp8_e4m3", wrong)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec.build("auto", torch.float32, 0, LAYERS, KV_HEADS, HEAD, None)


def test_fingerprint_follows_scales_and_format():
    ones = spec_of("fp8_e4m3")  # scales None: calculated later
    assert ones.scales_pending and ones.scales_source == PENDING_SOURCE
    assert ones.fingerprint == "fp8_e4m3:pending"
    a = KVScales([torch.tensor([0.01])] * LAYERS, [torch.tensor([0.02])] * LAYERS, "fp8_e4m3", "a")
    b = KVScales([torch.tensor([0.01])] * LAYERS, [torch.tensor([0.03])] * LAYERS, "fp8_e4m3", "b")
    with_a, with_b = ones.with_scales(a), ones.with_scales(b)
    assert not with_a.scales_pending and with_a.scales_source == "a"
    assert len({ones.fingerprint, with_a.fingerprint, with_b.fingerprint}) == 3
    assert spec_of("fp8_e4m3", a).fingerprint == with_a.fingerprint  # the values decide, not the object
    e5m2 = spec_of("fp8_e5m2", dataclasses.replace(a, fmt_name="fp8_e5m2"))
    assert e5m2.fingerprint != with_a.fingerprint
    assert dataclasses.replace(with_a, rotation="hadamard").fingerprint != with_a.fingerprint
    bf16_auto = KVCacheSpec.build("auto", torch.bfloat16, BLOCK, LAYERS, KV_HEADS, HEAD, None)
    assert spec_of("auto").fingerprint != bf16_auto.fingerprint


def test_calculated_scales_replace_the_spec(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8_e4m3", calculate_kv_scales=True)
    pending = runner.kv_spec
    assert pending.scales_pending and runner.cache_fingerprint == "fp8_e4m3:pending"
    ids = tiny_loaded.tokenizer("the city of the river was the first new school")["input_ids"]
    runner.execute(window_batch(ids, BLOCK))
    spec = runner.kv_spec
    assert spec is not pending and not spec.scales_pending
    assert spec.scales_source == "calculated from the first batch"
    assert runner.cache_fingerprint == spec.fingerprint != pending.fingerprint
    assert (spec.format, spec.window_size, spec.block_size) == (pending.format, pending.window_size, BLOCK)


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
def test_a_head_size_the_gpu_kernels_do_not_take_is_refused_at_start(backend):
    """What csrc/cuda/launch.h's kernels take (multiples of 16 up to 256; multiples of 8 up to 128 with a 16-bit
    cache on CUDA's tensor cores) builds; anything else fails when the engine starts, naming the fix."""
    def build(kv, dtype, head_size):
        return KVCacheSpec.build(kv, dtype, BLOCK, LAYERS, KV_HEADS, head_size, None, backend=backend)

    assert build("fp8_e4m3fnuz", torch.bfloat16, 256).head_size == 256
    assert build("auto", torch.float32, 48).head_size == 48
    with pytest.raises(ValueError, match="head size 36 is not supported by the GPU.*--device cpu"):
        build("auto", torch.float32, 36)
    with pytest.raises(ValueError, match="head size 272"):
        build("fp8_e4m3fnuz", torch.bfloat16, 272)
    if backend == "cuda":
        assert build("auto", torch.bfloat16, 40).head_size == 40
    else:
        with pytest.raises(ValueError, match="head size 40"):
            build("auto", torch.bfloat16, 40)
    with pytest.raises(ValueError, match="head size 40"):
        build("auto", torch.float32, 40)
    assert KVCacheSpec.build("auto", torch.float32, BLOCK, LAYERS, KV_HEADS, 36, None).head_size == 36  # CPU
