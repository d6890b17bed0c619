"""kv_cache_dtype_skip_layers (issue 54 part 3): the listed layers' cache holds the model dtype while the others
stay FP8. Checked against independent references: the auto and plain FP8 caches (all / no layers skipped), and a
one-shot prefill whose attention is a dense softmax per row over K/V quantized (or not) by the test's own list of
skipped layers with torch's float8 dtypes; sizing against the test's own arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
from hadamard_reference import walsh_hadamard
from test_recent_window import BLOCK, RingSeq, prompt_ids

from fp8cache import LLM
from fp8cache.config import EngineConfig
from fp8cache.kvcache import dynamic_scales, formats
from fp8cache.model import attention
from fp8cache.model.forward_context import ForwardContext
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference

LAYERS, KV_HEADS, HEAD = 2, 2, 64  # conftest's tiny model
MEMORY = 1 << 22


@pytest.fixture(scope="module")
def loaded(tiny_llama_path):
    return load_model(EngineConfig(model=tiny_llama_path), progress=False)


def make_runner(loaded, kv_cache_dtype: str = "fp8_e4m3", skip: tuple[int, ...] = (), log=None,
                **overrides) -> ModelRunner:
    overrides.setdefault("kv_recent_window", 0)
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                          kv_cache_memory=MEMORY, max_num_seqs=4, kv_cache_dtype_skip_layers=skip, **overrides)
    return ModelRunner(config, log=log or (lambda msg: None), loaded=loaded)


def run_steps(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits of a prefill in two chunks (the second reads the first from the cache) then decode steps (the CPU's
    whole-layer op)."""
    seq = RingSeq(runner, ids)
    got = [runner.execute(seq.chunk(0, 17), all_logits=True), runner.execute(seq.chunk(17, 30), all_logits=True)]
    got += [runner.execute(seq.chunk(p, p + 1)) for p in range(30, len(ids))]
    return torch.cat(got)


def dense_mixed_logits(runner: ModelRunner, ids: list[int], skip: set[int], dynamic: bool,
                       hadamard: bool = False) -> torch.Tensor:
    """The oracle: one step over `ids` whose attention is a dense causal softmax over K/V as a mixed cache holds
    them: layers in `skip` as computed, the others through float8 (E4M3) with the runner's static scales, or
    (dynamic) each token and head's own scale; hadamard: those quantized in the Walsh-Hadamard basis."""
    fmt = formats.FP8_FORMATS["fp8_e4m3"]
    h = (walsh_hadamard(HEAD) / HEAD ** 0.5).float()

    def as_cached(x: torch.Tensor, scale: torch.Tensor, layer: int) -> torch.Tensor:
        if layer in skip:
            return x.float()
        if hadamard:  # quantized rotated, read back in the model's basis (H is its own inverse)
            return as_quantized(x.float() @ h, scale) @ h
        return as_quantized(x, scale)

    def as_quantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if dynamic:
            scales = dynamic_scales.scales_of(dynamic_scales.token_head_amax(x), fmt.max).float()[..., None]
            return torch.clamp(x.float() * (1.0 / scales), -fmt.max, fmt.max).to(fmt.torch_dtype).float() * scales
        s = scale.float().reshape(1, -1, 1)
        return torch.clamp(x.float() / s, -fmt.max, fmt.max).to(fmt.torch_dtype).float() * s

    def dense(ctx: ForwardContext, layer: int, q, k, v, scaling: float, features=attention.PLAIN) -> torch.Tensor:
        keys, values = as_cached(k, ctx.k_scales[layer], layer), as_cached(v, ctx.v_scales[layer], layer)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True, scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1).to(q.dtype).contiguous()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "attend", dense)
        return runner.execute(RingSeq(runner, ids).chunk(0, len(ids)), all_logits=True)


# ---- the caches --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_scales", ["static", "dynamic"])
def test_skipped_layers_hold_the_model_dtype_and_size_the_blocks(loaded, kv_scales):
    runner = make_runner(loaded, skip=(1,), kv_scales=kv_scales)
    spec = runner.kv_spec
    assert spec.skip_layers == (1,) and spec.layer_formats == (formats.CacheFormat.E4M3FN, formats.CacheFormat.AUTO)
    (k0, v0), (k1, v1) = runner.kv_caches
    assert k0.dtype == v0.dtype == torch.uint8 and k1.dtype == v1.dtype == torch.float32
    assert k0.shape[2:] == (HEAD // 16, BLOCK, 16) and k1.shape[2:] == (HEAD // 4, BLOCK, 4)  # 16 bytes a chunk
    # Per token: layer 0 one byte per value (plus a bfloat16 scale per head for K and V when dynamic), layer 1 four.
    fp8_layer = 2 * KV_HEADS * HEAD + (2 * KV_HEADS * 2 if kv_scales == "dynamic" else 0)
    token_bytes = fp8_layer + 2 * KV_HEADS * HEAD * 4
    assert runner.bytes_per_token == token_bytes
    assert runner.num_blocks == MEMORY // (BLOCK * token_bytes)
    if kv_scales == "dynamic":
        assert runner.scale_caches[1] == () and runner.scale_caches[0][0].dtype == torch.bfloat16
    else:
        assert runner.scale_caches is None


def test_the_start_log_names_the_skipped_layers_and_their_bytes(loaded):
    lines: list[str] = []
    make_runner(loaded, skip=(0,), log=lines.append)
    line = next(m for m in lines if m.startswith("KV cache:"))
    assert line.startswith("KV cache: fp8_e4m3 (float32 in layer 0), ")
    assert f"{2 * KV_HEADS * HEAD * 5} bytes per token" in line


def test_info_names_the_skipped_layers_scales_and_rotation(loaded):
    """/info's kv_cache block (ModelInfo) says which layers stay 16-bit and how the FP8 ones are scaled."""
    from fp8cache.server.state import ModelInfo

    dynamic = ModelInfo.from_runner(make_runner(loaded, skip=(1,), kv_scales="dynamic", kv_rotation="hadamard"))
    assert (dynamic.skip_layers, dynamic.kv_scales, dynamic.kv_rotation) == ((1,), "dynamic", "hadamard")
    static = ModelInfo.from_runner(make_runner(loaded))
    assert (static.skip_layers, static.kv_scales, static.kv_rotation) == ((), "static", "none")


def test_bad_layer_ids_are_refused_naming_the_layer_count(loaded):
    with pytest.raises(ValueError, match=r"names layer 2, but the model has 2 layers \(0\.\.1\)"):
        make_runner(loaded, skip=(0, 2))
    for bad, says in (([-1], "integers >= 0"), ([1, 1], "names a layer twice"), ("0,x", "not a list of layer ids"),
                      ([True], "integers >= 0")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(kv_cache_dtype_skip_layers=bad)
    assert EngineConfig(kv_cache_dtype_skip_layers="3, 1").kv_cache_dtype_skip_layers == (1, 3)


def test_an_auto_cache_ignores_the_flag(loaded):
    lines: list[str] = []
    runner = make_runner(loaded, "auto", skip=(1,), log=lines.append)
    assert runner.kv_spec.skip_layers == () and all(k.dtype == torch.float32 for k, _ in runner.kv_caches)
    assert any("kv_cache_dtype_skip_layers is ignored with kv-cache-dtype auto" in m for m in lines)


def test_the_prefix_cache_fingerprint_tells_the_layer_formats_apart(loaded):
    prints = {make_runner(loaded, skip=skip).cache_fingerprint for skip in ((), (0,), (1,), (0, 1))}
    assert len(prints) == 4


# ---- the logits --------------------------------------------------------------------------------------------

SLOW = pytest.mark.slow  # more cases of what the fast lane checks once


@pytest.mark.parametrize("kv_scales", ["static", pytest.param("dynamic", marks=SLOW)])
def test_all_skipped_is_the_auto_cache_and_none_skipped_plain_fp8(loaded, kv_scales):
    ids = prompt_ids(40, seed=2)
    auto, fp8 = run_steps(make_runner(loaded, "auto"), ids), run_steps(make_runner(loaded, kv_scales=kv_scales), ids)
    all_skipped = run_steps(make_runner(loaded, skip=(0, 1), kv_scales=kv_scales), ids)
    none_skipped = run_steps(make_runner(loaded, skip=(), kv_scales=kv_scales), ids)
    mixed = run_steps(make_runner(loaded, skip=(1,), kv_scales=kv_scales), ids)
    torch.testing.assert_close(all_skipped, auto, atol=0, rtol=0)
    torch.testing.assert_close(none_skipped, fp8, atol=0, rtol=0)
    assert (fp8 - auto).abs().max() > 1e-3  # the FP8 cache does change them: the comparison can fail
    # one layer skipped is neither (a random tiny model's two layers need not order the distances to auto)
    assert (mixed - auto).abs().max() > 1e-3 and (mixed - fp8).abs().max() > 1e-3


@pytest.fixture
def small_scales(tmp_path) -> str:
    """Per-tensor scales under the tiny model's K/V, so that the FP8 layers' codes carry real rounding."""
    doc = {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {
        "0": 0.004, "1": 0.006}}}}
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("kv_scales,skip", [
    ("static", (1,)), ("dynamic-hadamard", (0,)), pytest.param("static", (0,), marks=SLOW),
    pytest.param("dynamic", (0,), marks=SLOW), pytest.param("dynamic", (1,), marks=SLOW),
    pytest.param("dynamic-hadamard", (1,), marks=SLOW)])
def test_mixed_cache_equals_a_dense_mixed_precision_reference(loaded, small_scales, skip, kv_scales):
    """Chunked prefill over a cached prefix and decode steps give the logits of one dense prefill whose FP8 layers
    read K/V through torch's float8_e4m3fn (rotated first with hadamard) and whose skipped layer reads them as
    computed: the skipped layer's decode runs the whole-layer op even where the rotated FP8 layer cannot."""
    extra = {"quantization_param_path": small_scales} if kv_scales == "static" else \
        {"kv_scales": "dynamic", "kv_rotation": kv_scales.removeprefix("dynamic-") if "-" in kv_scales else "none"}
    ids = prompt_ids(40, seed=4)
    runner = make_runner(loaded, skip=skip, **extra)
    assert runner.kv_rotation == ("hadamard" if kv_scales == "dynamic-hadamard" else "none")
    want = dense_mixed_logits(runner, ids, set(skip), kv_scales != "static", kv_scales == "dynamic-hadamard")
    torch.testing.assert_close(run_steps(runner, ids), want, atol=2e-4, rtol=1e-4)


@SLOW
def test_reference_ops_run_the_mixed_cache_as_the_compiled_ones(loaded, small_scales):
    """The pure-torch twin of the ops, given each layer's format, writes and reads the same caches."""
    ids = prompt_ids(30, seed=6)
    compiled = make_runner(loaded, skip=(1,), quantization_param_path=small_scales)
    twin = make_runner(loaded, skip=(1,), quantization_param_path=small_scales)
    want = run_steps(compiled, ids + [5, 6, 7])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("fp8cache.model.runner.ops", reference)
        patch.setattr("fp8cache.model.fused_layer.decode_layer.step_args", lambda ctx, layer: None)
        got = run_steps(twin, ids + [5, 6, 7])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    for (k_want, v_want), (k_got, v_got) in zip(compiled.kv_caches, twin.kv_caches):
        assert k_got.dtype == k_want.dtype and v_got.dtype == v_want.dtype


def test_skipped_layers_count_no_saturation(loaded, small_scales):
    """Scales far below the values clip the FP8 layer's K/V; the skipped layer stores them whole and counts none."""
    runner = make_runner(loaded, skip=(1,), quantization_param_path=small_scales)
    runner.saturation.sample_every = 1
    run_steps(runner, prompt_ids(40, seed=8))
    rows = {(r.layer, r.kind): r for r in runner.saturation_counts()}
    assert rows[(0, "k")].written > 0
    assert rows[(1, "k")].written == rows[(1, "v")].written == 0 and rows[(1, "k")].saturated == 0


def test_the_python_api_takes_the_layer_list(tiny_llama_path):
    llm = LLM(model=tiny_llama_path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=[1], kv_cache_memory="4MiB",
              max_num_seqs=2)
    runner = llm.llm_engine.runner
    assert runner.kv_spec.skip_layers == (1,) and runner.kv_caches[1][0].dtype == torch.float32


@pytest.mark.parametrize("kv_scales", [pytest.param("static", marks=SLOW), "dynamic"])
def test_a_mixed_cache_keeps_to_the_gpu(tiny_llama_path, kv_scales):
    """The GPU path (the stand-in device, fake_gpu.py): a bfloat16 model whose layer 1 keeps a bfloat16 cache beside
    layer 0's FP8 one runs chunked prefill, a prefix-cache hit, the recent window and decode with every tensor on
    the device."""
    from fake_gpu import fake_gpu
    from test_gpu_paths import _engine, _run

    from fp8cache.engine.sampling_params import SamplingParams

    shared = [5, 6, 7, 8] * 12
    with fake_gpu():
        engine = _engine(tiny_llama_path, kv_cache_dtype_skip_layers=(1,), kv_scales=kv_scales, kv_recent_window=8,
                         max_model_len=256, max_num_batched_tokens=32, kv_cache_memory="2MiB", max_num_seqs=2)
        caches = engine.runner.kv_caches
        assert caches[0][0].dtype == torch.uint8 and caches[1][0].dtype == torch.bfloat16
        engine.add_request("chunked", shared + [9], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
        _run(engine)
        engine.add_request("prefix-hit", shared + [11], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        _run(engine)
        assert engine.stats.prefix_cache_hits > 0


def test_the_flag_parses_reaches_the_config_and_goes_into_a_unit(monkeypatch):
    import os

    import click
    from click.testing import CliRunner

    from launcher.cli import main
    from launcher.options import engine_config
    from launcher.run import run

    for name in [n for n in os.environ if n.startswith("FP8KV_")]:
        monkeypatch.delenv(name)
    ctx = run.make_context("run", ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "3,0"])
    assert engine_config(None, ctx.params).kv_cache_dtype_skip_layers == (0, 3)
    monkeypatch.setenv("FP8KV_KV_CACHE_DTYPE_SKIP_LAYERS", "1")
    assert engine_config(None, run.make_context("run", []).params).kv_cache_dtype_skip_layers == (1,)
    with pytest.raises(click.BadParameter, match="not a list of layer ids; give them as 0,1,5"):
        run.make_context("run", ["--kv-cache-dtype-skip-layers", "0,x"])
    monkeypatch.delenv("FP8KV_KV_CACHE_DTYPE_SKIP_LAYERS")
    done = CliRunner().invoke(main, ["systemd-unit", "--template", "--kv-cache-dtype-skip-layers", "3,0"])
    assert done.exit_code == 0, done.output
    assert "--kv-cache-dtype-skip-layers 0,3" in done.output
