"""fp8cache.kvcache.formats against docs/design.md section 2 and torch's own float8 dtypes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fp8cache.kvcache import formats

ALL_CODES = torch.arange(256, dtype=torch.uint8)


def decoded(fmt: formats.Fp8Format) -> torch.Tensor:
    """Every one of the 256 codes read as `fmt` by torch, in float32."""
    return ALL_CODES.view(fmt.torch_dtype).to(torch.float32)


@pytest.mark.parametrize("backend", formats.BACKENDS)
@pytest.mark.parametrize("name", formats.KV_CACHE_DTYPES)
def test_every_string_resolves_on_every_backend(name, backend):
    canonical = formats.resolve_kv_cache_dtype(name, backend)
    assert canonical == formats.AUTO or canonical in formats.FP8_FORMATS
    if name != "fp8":
        assert canonical == name
    fmt = formats.get_format(name, backend)
    assert (fmt is None) == (name == formats.AUTO)
    assert formats.is_fp8(canonical) == (fmt is not None)


@pytest.mark.parametrize("backend, expected", [("cpu", torch.float8_e4m3fn), ("cuda", torch.float8_e4m3fn),
                                               ("rocm", torch.float8_e4m3fnuz)])
def test_plain_fp8_is_the_backends_native_format(backend, expected):
    assert formats.get_format("fp8", backend).torch_dtype == expected


@pytest.mark.parametrize("bad", ["fp16", "FP8", "", "fp8_e4m3fn", "float8_e4m3fn", " fp8", None, 8])
def test_unknown_strings_list_the_valid_choices(bad):
    with pytest.raises(formats.KVCacheDtypeError) as err:
        formats.resolve_kv_cache_dtype(bad)
    assert repr(bad) in str(err.value)
    for choice in formats.KV_CACHE_DTYPES:
        assert choice in str(err.value)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="tpu"):
        formats.resolve_kv_cache_dtype("fp8", "tpu")


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS.values(), ids=lambda f: f.name)
def test_constants_agree_with_torch_finfo(fmt):
    info = torch.finfo(fmt.torch_dtype)
    assert 1 + fmt.exponent_bits + fmt.mantissa_bits == info.bits == 8
    assert fmt.max == info.max
    assert info.eps == 2.0 ** -fmt.mantissa_bits
    assert info.smallest_normal == 2.0 ** (1 - fmt.bias)
    assert fmt.scale_file_dtype == str(fmt.torch_dtype).removeprefix("torch.")


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS.values(), ids=lambda f: f.name)
def test_bit_layout_matches_torch(fmt):
    values = decoded(fmt)
    m = fmt.mantissa_bits
    # exponent field 1 with mantissa 0 is the smallest normal; exponent field 0 holds the subnormals
    assert values[1 << m] == 2.0 ** (1 - fmt.bias)
    assert values[1] == 2.0 ** (1 - fmt.bias - m)  # smallest subnormal
    assert values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max() == fmt.max


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS.values(), ids=lambda f: f.name)
def test_nan_codes_are_exactly_the_codes_torch_decodes_to_nan(fmt):
    nan_codes = torch.isnan(decoded(fmt)).nonzero().flatten().tolist()
    assert tuple(nan_codes) == tuple(sorted(fmt.nan_codes))


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS.values(), ids=lambda f: f.name)
def test_inf_and_negative_zero_flags_match_torch(fmt):
    values = decoded(fmt)
    assert bool(torch.isinf(values).any()) == fmt.has_inf
    negative_zero = (values == 0) & torch.signbit(values)
    assert bool(negative_zero.any()) == fmt.has_negative_zero


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS.values(), ids=lambda f: f.name)
def test_scale_file_dtype_names_round_trip(fmt):
    assert formats.format_for_scale_file_dtype(fmt.scale_file_dtype) is fmt


def test_unknown_scale_file_dtype_lists_the_valid_ones():
    with pytest.raises(formats.KVCacheDtypeError) as err:
        formats.format_for_scale_file_dtype("float8_e3m4")
    for fmt in formats.FP8_FORMATS.values():
        assert fmt.scale_file_dtype in str(err.value)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", formats.KV_CACHE_DTYPES)
def test_storage_dtype_and_element_size(name, model_dtype):
    storage = formats.cache_storage_dtype(name, model_dtype)
    expected = model_dtype if name == formats.AUTO else torch.uint8
    assert storage == expected
    assert formats.bytes_per_element(name, model_dtype) == torch.empty((), dtype=expected).element_size()


def test_backend_of_cpu():
    assert formats.backend_of("cpu") == formats.backend_of(torch.device("cpu")) == formats.backend_of() == "cpu"


def test_cache_format_codes_match_the_csrc_enum():
    """The ops take CacheFormat as an int: csrc/common/cache_format.h's KVFormat must have the same names and
    values, or a format would be read as another by the kernels."""
    header = (Path(__file__).resolve().parents[2] / "csrc" / "common" / "cache_format.h").read_text()
    body = re.search(r"enum class KVFormat : int64_t \{(.*?)\};", header, re.DOTALL)
    assert body is not None, "KVFormat not found in cache_format.h"
    enumerators = re.findall(r"^\s*(\w+)\s*=\s*(-?\d+)\s*,", body.group(1), re.MULTILINE)
    assert {name: int(value) for name, value in enumerators} == {f.name: int(f) for f in formats.CacheFormat}


def test_format_codes_resolve_strings_once():
    assert formats.format_code("auto") is formats.CacheFormat.AUTO
    assert formats.format_code("fp8", "cpu") is formats.CacheFormat.E4M3FN
    assert formats.format_code("fp8", "cuda") is formats.CacheFormat.E4M3FN
    assert formats.format_code("fp8", "rocm") is formats.CacheFormat.E4M3FNUZ
    for name, code in formats.FORMAT_CODES.items():
        assert formats.format_code(name) == code and formats.format_code(code) == code
        assert formats.format_name(code) == name and formats.format_name(int(code)) == name
        assert formats.get_format(code) is formats.get_format(name)
    for bad in ("fp16", 4, -1, True, 1.0):
        with pytest.raises(formats.KVCacheDtypeError):
            formats.format_code(bad)
