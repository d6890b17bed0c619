"""csrc/common/fp8.h against torch's own float8 dtypes, through the quantize_fp8 / dequantize_fp8 ops."""

from __future__ import annotations

import pytest
import torch

from fp8cache.kvcache import formats

FORMATS = list(formats.FP8_FORMATS.values())
SCALES = [1.0, 0.0173, 3.7, 2.0 ** -10]


@pytest.fixture(scope="module")
def ops():
    """The documented Python API, which takes kv-cache-dtype strings and hands the compiled ops a format code."""
    import fp8cache.ops

    fp8cache.ops.load()
    return fp8cache.ops


def torch_codes(x: torch.Tensor, scale: torch.Tensor, fmt: formats.Fp8Format) -> torch.Tensor:
    """The contract: torch.clamp(x / s, -max, max).to(torch.float8_*), s broadcast over dim -2."""
    s = scale.reshape(-1, 1) if scale.numel() > 1 else scale
    return torch.clamp(x.float() / s, -fmt.max, fmt.max).to(fmt.torch_dtype).view(torch.uint8)


def edge_values(fmt: formats.Fp8Format) -> torch.Tensor:
    """Every FP8 value, the midpoints between neighbours (ties) and the floats just beside them, plus
    zeros, fp32 subnormals, the saturation boundary, infinities and NaNs."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
    finite = torch.unique(values[torch.isfinite(values)].abs())  # sorted magnitudes, 0 included
    mids = (finite[1:] + finite[:-1]) / 2  # exact in float32
    beside = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    top = torch.tensor([fmt.max, fmt.max * 1.0625, fmt.max * 2, 1e30, 3.4e38])
    top = torch.cat([top, torch.nextafter(top[:1], torch.tensor(1e9))])
    specials = torch.tensor([0.0, 1e-45, 1e-40, 1.17e-38, float("inf"), float("nan")])
    magnitudes = torch.cat([finite, mids, beside, top, specials, finite[1:2] / 2, finite[1:2] / 4])
    return torch.cat([magnitudes, -magnitudes])


def random_values(n: int, seed: int) -> torch.Tensor:
    """Normal values over magnitudes 2^-30 .. 2^20 (subnormal and saturating ranges of all formats)."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-30, 21, (n,), generator=g).float()
    return torch.randn(n, generator=g) * torch.exp2(exponent)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_code_decodes_like_torch(ops, fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    got = ops.dequantize_fp8(codes, fmt.name, torch.ones(1), torch.float32)
    want = codes.view(fmt.torch_dtype).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0 included


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", SCALES)
def test_encoding_matches_torch_bit_for_bit(ops, fmt, scale):
    x = torch.cat([edge_values(fmt) * scale, random_values(250_000, seed=int(scale * 1000) + 7)])
    s = torch.tensor([scale])
    got = ops.quantize_fp8(x, fmt.name, s)
    want = torch_codes(x, s, fmt)
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} mismatches, e.g. x={x[mismatch[:5]].tolist()} got={got[mismatch[:5]].tolist()} "
        f"want={want[mismatch[:5]].tolist()}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_nan_and_signed_zero_codes(ops, fmt):
    x = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, -1e-30, float("inf"), -float("inf")])
    got = ops.quantize_fp8(x, fmt.name, torch.ones(1))
    assert torch.equal(got, torch_codes(x, torch.ones(1), fmt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_head_scales_and_input_dtypes(ops, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 4, 32, generator=g) * 5).to(dtype)
    scale = torch.tensor([0.01, 0.5, 2.0, 0.03])
    for fmt in FORMATS:
        codes = ops.quantize_fp8(x, fmt.name, scale)
        assert torch.equal(codes, torch_codes(x, scale, fmt))
        values = ops.dequantize_fp8(codes, fmt.name, scale, dtype)
        want = (codes.view(fmt.torch_dtype).float() * scale.reshape(-1, 1)).to(dtype)
        assert values.dtype == dtype
        torch.testing.assert_close(values, want, rtol=0, atol=0, equal_nan=True)


def test_fp8_alias_means_e4m3fn_on_cpu(ops):
    x = random_values(10_000, seed=11)
    s = torch.tensor([0.05])
    assert torch.equal(ops.quantize_fp8(x, "fp8", s), ops.quantize_fp8(x, "fp8_e4m3", s))


def test_bad_kv_cache_dtype_is_a_clear_error(ops):
    with pytest.raises(RuntimeError, match="valid choices are: auto, fp8, fp8_e4m3, fp8_e5m2, fp8_e4m3fnuz"):
        ops.quantize_fp8(torch.ones(4), "fp8_e4m2", torch.ones(1))
    with pytest.raises(RuntimeError, match="not 'auto'"):
        ops.quantize_fp8(torch.ones(4), "auto", torch.ones(1))
    with pytest.raises(RuntimeError, match="dim -2"):
        ops.quantize_fp8(torch.ones(3, 8), "fp8", torch.ones(2))
