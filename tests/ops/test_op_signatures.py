"""Each op's signature is declared once, as the schema that registers it (fp8cache.ops.signatures reads them from
csrc/), and every other face of the op follows it: the C++ parameter lists of the backends (names and order;
torch checks only the types), the Python wrappers, the fake kernels, the pure-torch reference and the schema the
built CPU library registers. A face that drifts (a renamed, reordered, missing or extra parameter, another
default) fails here, named."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from fp8cache import ops
from fp8cache.ops import _build, fake, reference, signatures

CSRC = _build.source_dir()
SCHEMAS = signatures.declared_schemas()
EMPTY = inspect.Parameter.empty

# ---- the C++ parameter lists ---------------------------------------------------------------------------

# A function definition or declaration at the start of a line with a return type the torch-facing ops have (the
# host emulation's torch-free namesakes return int).
_CPP_FUNCTION = r"^(?:void|at::Tensor|bool|std::string)\s+{name}\("
_MACRO = re.compile(r"^#define (FP8KV_\w+_PARAMS)\s*\\\n((?:.*\\\n)*.*)$", re.MULTILINE)


def _param_macros() -> dict[str, str]:
    text = (CSRC / "op_signatures.h").read_text(encoding="utf-8")
    return {m.group(1): m.group(2).replace("\\\n", " ") for m in _MACRO.finditer(text)}


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def cpp_parameter_names(source: str, name: str, macros: dict[str, str]) -> list[list[str]]:
    """The parameter names of every C++ definition or declaration of `name` in source, macros expanded."""
    found = []
    for match in re.finditer(_CPP_FUNCTION.format(name=name), source, re.MULTILINE):
        i, depth = match.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        params = source[match.end():i - 1].strip()
        params = macros.get(params, params)
        found.append([re.search(r"(\w+)\s*$", p.split("=")[0]).group(1) for p in _split_top_level(params)])
    return found


def _backend_sources() -> dict[str, str]:
    files = [*CSRC.glob("*.cpp"), *CSRC.glob("cpu/*.h"), *CSRC.glob("cpu/*.cpp"), *CSRC.glob("cuda/*.cu")]
    return {str(p.relative_to(CSRC)): p.read_text(encoding="utf-8") for p in files}


def cpp_mismatches(schemas: dict[str, torch.FunctionSchema]) -> list[str]:
    macros, sources, problems = _param_macros(), _backend_sources(), []
    for name, schema in schemas.items():
        want = [n for n, _ in signatures.parameters(schema)]
        for path, text in sources.items():
            for names in cpp_parameter_names(text, name, macros):
                if names != want:
                    problems.append(f"{path}: {name}({', '.join(names)}) but the schema has ({', '.join(want)})")
    return problems


def test_every_cpp_parameter_list_follows_its_schema() -> None:
    assert cpp_mismatches(SCHEMAS) == []


def test_both_backends_define_each_shared_op_with_the_declared_parameters() -> None:
    header = (CSRC / "op_signatures.h").read_text(encoding="utf-8")
    shared = re.findall(r"X\((\w+)\)", header.split("#define FP8KV_FOR_EACH_BACKEND_OP(X)")[1])
    assert {"reshape_and_cache", "paged_attention", "paged_attention_window"} <= set(shared)
    macros, sources = _param_macros(), _backend_sources()
    for name in shared:
        want = [n for n, _ in signatures.parameters(SCHEMAS[name])]
        for backend in ("cpu/", "cuda/"):
            lists = [names for path, text in sources.items() if path.startswith(backend)
                     for names in cpp_parameter_names(text, name, macros)]
            assert lists and all(names == want for names in lists), (name, backend, lists)


def test_a_swapped_cpp_parameter_is_found() -> None:
    # The schema as it would read had someone swapped k_scale and v_scale in it (and not in the C++).
    text = str(SCHEMAS["paged_attention"]).replace("Tensor k_scale, Tensor v_scale", "Tensor v_scale, Tensor k_scale")
    drifted = {"paged_attention": torch._C.parse_schema(text)}
    problems = cpp_mismatches(drifted)
    assert problems and all("paged_attention(" in p for p in problems)
    assert any(p.startswith("cpu/attention.cpp") for p in problems)
    assert any(p.startswith("cuda/torch_bindings_cuda.cu") for p in problems)


# ---- the Python faces -------------------------------------------------------------------------------

def python_mismatch(fn, schema: torch.FunctionSchema, python_names: bool, extra_defaults: bool = False) -> str | None:
    """Why fn's parameters are not the schema's (names, order, defaults), or None. extra_defaults: fn may give a
    default where the schema has none (a wrapper's convenience)."""
    want = signatures.parameters(schema, python=python_names)
    got = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
    if [n for n, _ in got] != [n for n, _ in want]:
        return f"{fn.__module__}.{fn.__name__} takes {[n for n, _ in got]}, the schema {[n for n, _ in want]}"
    for (name, has), (_, should) in zip(got, want):
        same = has == should and type(has) is type(should) if should is not EMPTY else (has is EMPTY or extra_defaults)
        if not same:
            return f"{fn.__module__}.{fn.__name__}: {name}'s default is {has!r}, the schema's {should!r}"
    return None


WRAPPED = sorted(n for n in ops.__all__ if n in SCHEMAS)
FAKED = sorted(fake._FAKES)
REFERENCED = sorted(n for n in SCHEMAS if callable(getattr(reference, n, None)))


def test_the_faces_cover_the_ops_they_should() -> None:
    assert {"reshape_and_cache", "paged_attention", "paged_attention_window", "quantize_fp8", "rms_norm"} <= set(
        WRAPPED)
    assert set(FAKED) <= set(SCHEMAS), "a fake kernel for an op that no schema declares"
    assert {"reshape_and_cache", "paged_attention", "paged_attention_window", "silu_and_mul"} <= set(REFERENCED)


@pytest.mark.parametrize("name", WRAPPED)
def test_the_python_wrapper_follows_the_schema(name: str) -> None:
    assert python_mismatch(getattr(ops, name), SCHEMAS[name], python_names=True, extra_defaults=True) is None


@pytest.mark.parametrize("name", FAKED)
def test_the_fake_kernel_follows_the_schema(name: str) -> None:
    assert python_mismatch(fake._FAKES[name], SCHEMAS[name], python_names=False) is None


@pytest.mark.parametrize("name", REFERENCED)
def test_the_reference_follows_the_schema(name: str) -> None:
    assert python_mismatch(getattr(reference, name), SCHEMAS[name], python_names=True) is None


def test_a_drifted_python_face_is_found() -> None:
    schema = SCHEMAS["paged_attention_window"]

    def reordered(out, query, key_cache, value_cache, window_value_cache, window_key_cache, *rest):
        pass

    def other_default(out, query, key_cache, value_cache, window_key_cache, window_value_cache, num_kv_heads, scale,
                      block_tables, window_block_tables, seq_lens, window_starts, window_size, block_size,
                      max_seq_len, alibi_slopes, kv_cache_format, k_scale, v_scale, sliding_window=0,
                      logit_softcap=0, sinks=None, k_scale_cache=None, v_scale_cache=None, window_sinks=0):
        pass

    assert "takes" in python_mismatch(reordered, schema, python_names=False)
    assert "logit_softcap's default is 0" in python_mismatch(other_default, schema, python_names=False)
    assert "kv_cache_dtype" in python_mismatch(fake.paged_attention_window, schema, python_names=True)


# ---- the built library ------------------------------------------------------------------------------

def test_the_built_library_registers_the_declared_schemas() -> None:
    ops.load("cpu")
    registered = {n.removeprefix("fp8kv::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("fp8kv::")}
    assert registered <= set(SCHEMAS), f"registered but not declared: {registered - set(SCHEMAS)}"
    # set_gpu_error_flag is declared beside the CUDA kernels: a CPU build has no such op.
    assert set(SCHEMAS) - registered <= {"set_gpu_error_flag"}
    for name in registered:
        assert str(getattr(torch.ops.fp8kv, name).default._schema) == str(SCHEMAS[name]), name


def test_the_declarations_are_read_from_every_source(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "a.cpp").write_text('TORCH_LIBRARY(fp8kv, m) {\n  m.def(\n      "f(Tensor x, "\n      '
                                    '"int n=2) -> Tensor");\n}\n')
    (tmp_path / "cpu" / "b.cu").write_text('TORCH_LIBRARY_FRAGMENT(fp8kv, m) { m.def("g() -> ()", &g); }\n')
    schemas = signatures.declared_schemas(tmp_path)
    assert sorted(schemas) == ["f", "g"]
    assert signatures.parameters(schemas["f"], python=True) == [("x", EMPTY), ("n", 2)]
    (tmp_path / "c.cpp").write_text('m.def("f() -> ()");\n')
    with pytest.raises(ValueError, match="'f' is declared twice"):
        signatures.declared_schemas(tmp_path)
