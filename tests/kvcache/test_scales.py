"""fp8cache.kvcache.scales against docs/design.md section 3: files, checkpoints, precedence, computed scales."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fp8cache.kvcache import formats
from fp8cache.kvcache.scale_files import (
    MAX_SCALES_FILE_BYTES,
    load_scales_file,
    resolve_scales,
    scales_from_checkpoint,
    write_scales_file,
)
from fp8cache.kvcache.scales import (
    MAX_SCALE,
    MIN_SCALE,
    CheckpointScalesError,
    KVScales,
    ScalesFileError,
    compute_scales,
    ones,
)
from fp8cache.ops import reference

FORMAT_NAMES = list(formats.FP8_FORMATS)
HYPOTHESIS = settings(max_examples=40, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# float32-exact positive scales, so a JSON round trip can be compared bit for bit
scale_values = st.floats(min_value=2.0 ** -20, max_value=2.0 ** 10, width=32, allow_nan=False,
                         allow_infinity=False)


@st.composite
def kv_scales(draw, fmt_names=FORMAT_NAMES):
    num_layers = draw(st.integers(1, 5))
    num_kv_heads = draw(st.integers(1, 6))
    granularity = draw(st.sampled_from(["tensor", "head", "mixed"]))
    separate = draw(st.booleans())

    def one_layer():
        per_head = granularity == "head" or (granularity == "mixed" and draw(st.booleans()))
        n = num_kv_heads if per_head else 1
        return torch.tensor(draw(st.lists(scale_values, min_size=n, max_size=n)), dtype=torch.float32)

    k = [one_layer() for _ in range(num_layers)]
    v = [one_layer() for _ in range(num_layers)] if separate else [t.clone() for t in k]
    rotation = draw(st.sampled_from(["none", "hadamard"]))
    # Rotated scales carry the scale of the unrotated K/V for vLLM's plain scaling_factor.
    unrotated = [draw(scale_values) for _ in range(num_layers)] if rotation != "none" else None
    scales = KVScales(k, v, draw(st.sampled_from(fmt_names)), "test", rotation, unrotated)
    return scales, num_kv_heads


def write_and_load(scales: KVScales, num_kv_heads: int, load_as: str, tp_rank: int = 0,
                   tp_size: int = 1) -> KVScales:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "scales.json")
        write_scales_file(path, scales, "llama", num_kv_heads)
        return load_scales_file(path, scales.num_layers, num_kv_heads, load_as, tp_rank, tp_size)


def assert_same_values(a: list[torch.Tensor], b: list[torch.Tensor], factor: float = 1.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype == torch.float32
        assert torch.equal(x * factor, y)


# ---------------------------------------------------------------------------------------------------
# write -> load round trips


@HYPOTHESIS
@given(kv_scales())
def test_write_then_load_gives_the_same_scales(drawn):
    scales, num_kv_heads = drawn
    loaded = write_and_load(scales, num_kv_heads, scales.fmt_name)
    assert_same_values(scales.k, loaded.k)
    assert_same_values(scales.v, loaded.v)
    assert loaded.fmt_name == scales.fmt_name
    assert loaded.rotation == scales.rotation
    assert loaded.unrotated_scales == scales.unrotated_scales
    assert loaded.per_head() == scales.per_head()
    assert loaded.source.startswith("file ") and loaded.source.endswith("scales.json")
    assert loaded.fingerprint() == scales.fingerprint()


@HYPOTHESIS
@given(kv_scales(fmt_names=["fp8_e4m3", "fp8_e4m3fnuz"]))
def test_e4m3fn_and_e4m3fnuz_scales_convert_by_a_factor_of_two(drawn):
    scales, num_kv_heads = drawn
    other = "fp8_e4m3fnuz" if scales.fmt_name == "fp8_e4m3" else "fp8_e4m3"
    factor = 2.0 if other == "fp8_e4m3fnuz" else 0.5
    converted = write_and_load(scales, num_kv_heads, other)
    assert converted.fmt_name == other
    assert_same_values(scales.k, converted.k, factor)
    assert_same_values(scales.v, converted.v, factor)
    back = write_and_load(converted, num_kv_heads, scales.fmt_name)
    assert_same_values(scales.k, back.k)
    assert_same_values(scales.v, back.v)
    assert back.fingerprint() == scales.fingerprint() != converted.fingerprint()


E4M3_NAMES = ("fp8_e4m3", "fp8_e4m3fnuz")


@HYPOTHESIS
@given(kv_scales(), st.sampled_from(FORMAT_NAMES))
def test_scales_serve_only_a_cache_of_their_format_or_its_e4m3_twin(drawn, cache):
    # Scales place K/V on one format's grid: E4M3FN and E4M3FNUZ share theirs up to a factor of two (above);
    # E5M2's is another grid, so E4M3 scales on an E5M2 cache (or the reverse) would store garbage.
    scales, num_kv_heads = drawn
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "scales.json")
        write_scales_file(path, scales, "llama", num_kv_heads)
        if scales.fmt_name == cache or {scales.fmt_name, cache} <= set(E4M3_NAMES):
            assert load_scales_file(path, scales.num_layers, num_kv_heads, cache).fmt_name == cache
            return
        with pytest.raises(ScalesFileError) as err:
            load_scales_file(path, scales.num_layers, num_kv_heads, cache)
    made_for, serving = formats.FP8_FORMATS[scales.fmt_name], formats.FP8_FORMATS[cache]
    message = str(err.value)
    assert path in message and err.value.key == "kv_cache.dtype"
    assert made_for.scale_file_dtype in message and serving.scale_file_dtype in message
    assert f"--kv-cache-dtype {scales.fmt_name}" in err.value.fix
    assert f"fp8kv calibrate --kv-cache-dtype {cache}" in err.value.fix


@pytest.mark.parametrize("cache", FORMAT_NAMES)
def test_a_file_without_a_dtype_is_used_as_is_with_a_warning_showing_its_range(tmp_path, cache):
    doc = valid_doc()
    del doc["kv_cache"]["dtype"]
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(doc))
    warnings: list[str] = []
    loaded = load_scales_file(path, NUM_LAYERS, NUM_HEADS, cache, warn=warnings.append)
    for name, got in (("k_scaling_factor", loaded.k), ("v_scaling_factor", loaded.v)):
        for layer, t in enumerate(got):
            value = doc["kv_cache"][name]["0"][str(layer)]
            assert t.tolist() == (value if isinstance(value, list) else [value])  # not converted
    values = [x for name in ("k_scaling_factor", "v_scaling_factor") for layer in doc["kv_cache"][name]["0"].values()
              for x in (layer if isinstance(layer, list) else [layer])]
    fmt = formats.FP8_FORMATS[cache]
    assert len(warnings) == 1
    for text in (str(path), "kv_cache.dtype", f"{min(values):.3g}", f"{max(values):.3g}",
                 f"{min(values) * fmt.max:.3g}", f"{max(values) * fmt.max:.3g}", fmt.scale_file_dtype):
        assert text in warnings[0], text
    # resolve_scales passes its warn on, so the runner logs it
    got: list[str] = []
    resolve_scales(cache, NUM_LAYERS, NUM_HEADS, path, warn=got.append)
    assert got == warnings


def read_like_vllm(path: str, num_layers: int) -> list[float]:
    """A reader that knows only vLLM's schema: kv_cache.scaling_factor[rank 0][layer]."""
    with open(path) as f:
        kv_cache = json.load(f)["kv_cache"]
    layers = kv_cache["scaling_factor"]["0"]
    return [float(layers[str(i)]) for i in range(num_layers)]


@HYPOTHESIS
@given(kv_scales())
def test_vllm_only_readers_get_one_conservative_scale_per_layer(drawn):
    scales, num_kv_heads = drawn
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "scales.json")
        write_scales_file(path, scales, "llama", num_kv_heads)
        plain = read_like_vllm(path, scales.num_layers)
        with open(path) as f:
            doc = json.load(f)
    assert doc["model_type"] == "llama"
    assert doc["kv_cache"]["dtype"] == formats.FP8_FORMATS[scales.fmt_name].scale_file_dtype
    assert ("kv_rotation" in doc) == (scales.rotation != "none")
    for layer, value in enumerate(plain):
        if scales.rotation != "none":  # they apply it to unrotated K/V: the unrotated scale, not k/v's
            assert value == scales.unrotated_scales[layer]
            continue
        every = torch.cat([scales.k[layer], scales.v[layer]]).tolist()
        assert value == max(every)  # large enough that neither K nor V saturates
        assert all(value >= x for x in every)


def test_a_plain_vllm_file_uses_one_scale_for_k_and_v(tmp_path):
    path = tmp_path / "vllm.json"
    values = [0.0152, 0.0188, 0.5]
    path.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(i): x for i, x in enumerate(values)}}}}))
    loaded = load_scales_file(path, 3, 4, "fp8_e4m3")
    expected = [torch.tensor([x], dtype=torch.float32) for x in values]
    assert_same_values(expected, loaded.k)
    assert_same_values(expected, loaded.v)
    assert not loaded.per_head()


def test_separate_k_and_v_win_over_scaling_factor(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 9.0, "1": 9.0}},
        "k_scaling_factor": {"0": {"0": 0.25, "1": [0.5, 0.75]}}}}))
    loaded = load_scales_file(path, 2, 2, "fp8_e4m3")
    assert loaded.k[0].tolist() == [0.25] and loaded.k[1].tolist() == [0.5, 0.75]
    assert loaded.v[0].tolist() == [9.0] and loaded.v[1].tolist() == [9.0]  # V falls back to the plain table


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text("old")
    write_scales_file(path, ones(2, "fp8_e4m3"), "llama", 1)
    assert [p.name for p in tmp_path.iterdir()] == ["scales.json"]
    assert json.loads(path.read_text())["kv_cache"]["scaling_factor"] == {"0": {"0": 1.0, "1": 1.0}}


@pytest.mark.parametrize("bad", [torch.tensor([0.0]), torch.tensor([float("nan")]), torch.tensor([1.0, 2.0])])
def test_write_refuses_scales_it_could_not_read_back(tmp_path, bad):
    scales = KVScales([torch.ones(1), bad], [torch.ones(1), torch.ones(1)], "fp8_e4m3", "test")
    with pytest.raises(ValueError, match="layer 1"):
        write_scales_file(tmp_path / "s.json", scales, "llama", num_kv_heads=3)
    assert not (tmp_path / "s.json").exists()


# ---------------------------------------------------------------------------------------------------
# errors: every one names the file, the key and a fix

NUM_LAYERS, NUM_HEADS = 3, 2


def valid_doc() -> dict:
    return {"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn",
        "scaling_factor": {"0": {"0": 0.5, "1": 0.25, "2": 0.125}},
        "k_scaling_factor": {"0": {"0": 0.5, "1": [0.25, 0.5], "2": 0.125}},
        "v_scaling_factor": {"0": {"0": [0.5, 0.5], "1": 0.25, "2": 0.125}}}}


def set_key(doc: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        doc = doc[p]
    doc[last] = value


def del_key(doc: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        doc = doc[p]
    del doc[last]


def rename_layer(doc, old, new):
    table = doc["kv_cache"]["scaling_factor"]["0"]
    table[new] = table.pop(old)


ERROR_CASES = {
    "missing kv_cache": (lambda d: del_key(d, "kv_cache"), "kv_cache"),
    "kv_cache not an object": (lambda d: set_key(d, "kv_cache", [1, 2]), "kv_cache"),
    "unknown dtype": (lambda d: set_key(d, "kv_cache.dtype", "float8_e3m4"), "kv_cache.dtype"),
    "missing scaling_factor": (lambda d: del_key(d, "kv_cache.scaling_factor") or
                               del_key(d, "kv_cache.v_scaling_factor"), "kv_cache.scaling_factor"),
    "too few layers": (lambda d: del_key(d, "kv_cache.scaling_factor.0.2"), "kv_cache.scaling_factor.0"),
    "too many layers": (lambda d: set_key(d, "kv_cache.k_scaling_factor.0.3", 1.0),
                        "kv_cache.k_scaling_factor.0"),
    "a layer missing": (lambda d: rename_layer(d, "1", "3"), "kv_cache.scaling_factor.0.1"),
    "a non-integer layer": (lambda d: rename_layer(d, "2", "two"), "kv_cache.scaling_factor.0.two"),
    "empty rank table": (lambda d: set_key(d, "kv_cache.scaling_factor", {}), "kv_cache.scaling_factor"),
    "rank count mismatch": (lambda d: set_key(d, "kv_cache.scaling_factor.1", {"0": 1, "1": 1, "2": 1}),
                            "kv_cache.scaling_factor"),
    "per-head list too short": (lambda d: set_key(d, "kv_cache.k_scaling_factor.0.1", [0.5]),
                                "kv_cache.k_scaling_factor.0.1"),
    "per-head list too long": (lambda d: set_key(d, "kv_cache.v_scaling_factor.0.0", [0.5] * 3),
                               "kv_cache.v_scaling_factor.0.0"),
    "a string": (lambda d: set_key(d, "kv_cache.scaling_factor.0.1", "0.5"), "kv_cache.scaling_factor.0.1"),
    "null": (lambda d: set_key(d, "kv_cache.scaling_factor.0.1", None), "kv_cache.scaling_factor.0.1"),
    "a boolean": (lambda d: set_key(d, "kv_cache.scaling_factor.0.1", True), "kv_cache.scaling_factor.0.1"),
    "an object": (lambda d: set_key(d, "kv_cache.scaling_factor.0.1", {"a": 1}), "kv_cache.scaling_factor.0.1"),
    "zero": (lambda d: set_key(d, "kv_cache.scaling_factor.0.2", 0), "kv_cache.scaling_factor.0.2"),
    "negative": (lambda d: set_key(d, "kv_cache.scaling_factor.0.2", -0.5), "kv_cache.scaling_factor.0.2"),
    "NaN": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", float("nan")), "kv_cache.scaling_factor.0.0"),
    "inf": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", float("inf")), "kv_cache.scaling_factor.0.0"),
    "beyond float32": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", 1e39), "kv_cache.scaling_factor.0.0"),
    "zero in float32": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", 1e-50),
                        "kv_cache.scaling_factor.0.0"),
    "subnormal in float32": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", 1e-40),
                             "kv_cache.scaling_factor.0.0"),
    "below the scale floor": (lambda d: set_key(d, "kv_cache.k_scaling_factor.0.2", 1e-13),
                              "kv_cache.k_scaling_factor.0.2"),
    "near float32's largest": (lambda d: set_key(d, "kv_cache.scaling_factor.0.0", 1e38),
                               "kv_cache.scaling_factor.0.0"),
    "above the scale ceiling": (lambda d: set_key(d, "kv_cache.v_scaling_factor.0.0", [0.5, 1e13]),
                                "kv_cache.v_scaling_factor.0.0[1]"),
    "an integer beyond float64": (lambda d: set_key(d, "kv_cache.scaling_factor.0.1", 10 ** 400),
                                  "kv_cache.scaling_factor.0.1"),
    "NaN in a per-head list": (lambda d: set_key(d, "kv_cache.v_scaling_factor.0.0", [0.5, float("nan")]),
                               "kv_cache.v_scaling_factor.0.0[1]"),
    "negative in a per-head list": (lambda d: set_key(d, "kv_cache.k_scaling_factor.0.1", [-1.0, 0.5]),
                                    "kv_cache.k_scaling_factor.0.1[0]"),
    "unknown rotation": (lambda d: set_key(d, "kv_rotation", "givens"), "kv_rotation"),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=str)
def test_bad_files_name_the_file_the_key_and_a_fix(tmp_path, case):
    mutate, key = ERROR_CASES[case]
    path = tmp_path / "scales.json"
    doc = valid_doc()
    path.write_text(json.dumps(doc))
    load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")  # the base is valid
    mutate(doc)
    path.write_text(json.dumps(doc))  # json writes NaN/Infinity, which json.load reads back
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    message = str(err.value)
    assert str(path) in message
    assert f"key {key}:" in message
    assert err.value.fix and err.value.fix in message


def test_layer_count_mismatch_says_how_to_make_scales_for_this_model(tmp_path):
    path = tmp_path / "scales.json"
    write_scales_file(path, ones(24, "fp8_e4m3"), "llama", 3)
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, 30, 3, "fp8_e4m3")
    assert "the file has 24 layers, the model 30" in str(err.value)
    assert "fp8kv calibrate" in str(err.value)


def test_unknown_dtype_lists_the_valid_ones(tmp_path):
    path = tmp_path / "scales.json"
    doc = valid_doc()
    doc["kv_cache"]["dtype"] = "int8"
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    for fmt in formats.FP8_FORMATS.values():
        assert fmt.scale_file_dtype in str(err.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    assert str(path) in str(err.value) and "does not exist" in str(err.value)
    assert "--quantization-param-path" in str(err.value)


@pytest.mark.parametrize("text", ["", "{", '{"kv_cache": }', "not json", "\xff", "[1, 2]", "3"])
def test_invalid_json(tmp_path, text):
    path = tmp_path / "broken.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    assert str(path) in str(err.value) and "JSON" in str(err.value)


def test_the_range_limits_admit_every_scale_calibration_can_write(tmp_path):
    # An all-zero head gets the floor (compute_scales and calibrate clamp to it); the ceiling itself passes.
    floor = compute_scales([torch.zeros(2)], [torch.full((2,), 448.0 * 1e12)], "fp8_e4m3", "head")
    assert floor.k[0].tolist() == [float(torch.tensor(MIN_SCALE, dtype=torch.float32))] * 2
    path = tmp_path / "edges.json"
    write_scales_file(path, floor, "llama", 2)
    loaded = load_scales_file(path, 1, 2, "fp8_e4m3")
    assert torch.equal(loaded.k[0], floor.k[0]) and torch.equal(loaded.v[0], floor.v[0])
    assert float(loaded.v[0][0]) == pytest.approx(MAX_SCALE, rel=1e-6)


def test_deeply_nested_json_is_a_clean_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"kv_cache": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    assert str(path) in str(err.value) and "nested too deeply" in str(err.value)


def test_a_file_larger_than_any_scales_file_is_refused_unread(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_SCALES_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ScalesFileError) as err:
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
    assert str(path) in str(err.value) and "larger than 16 MiB" in str(err.value)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    import threading

    path = tmp_path / "scales.json"
    os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8_e4m3")
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (reported below, in the test's thread)
            outcome.append(e)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # blocked in open(): a writer lets it go, so the test process is not left hanging
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=20)
        pytest.fail("loading a FIFO waited for a writer")
    assert isinstance(outcome[0], ScalesFileError), outcome
    assert "a FIFO, not a regular file" in str(outcome[0]) and str(path) in str(outcome[0])


def test_a_link_to_an_endless_device_is_refused_unread(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "scales.json"
    os.symlink("/dev/zero", path)
    # In a child with an address-space cap: reading /dev/zero to the end must fail the test, not the machine.
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            "from fp8cache.kvcache.scale_files import ScalesFileError, load_scales_file\n"
            "try:\n    load_scales_file(sys.argv[1], 3, 2, 'fp8_e4m3')\n"
            "except ScalesFileError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a device, not a regular file" in done.stdout and str(path) in done.stdout


def test_fp8_must_be_resolved_before_loading(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(valid_doc()))
    with pytest.raises(ValueError, match="resolve"):
        load_scales_file(path, NUM_LAYERS, NUM_HEADS, "fp8")


# ---------------------------------------------------------------------------------------------------
# tensor parallelism


def test_a_file_with_several_ranks_gives_each_rank_its_own(tmp_path):
    path = tmp_path / "scales.json"
    # 4 KV heads over 2 ranks: each rank's per-head lists hold its own 2 heads
    ranks = {str(r): {"0": 0.5 + r, "1": [0.25 + r, 0.75 + r]} for r in range(2)}
    path.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": ranks}}))
    for r in range(2):
        loaded = load_scales_file(path, 2, 4, "fp8_e4m3", tp_rank=r, tp_size=2)
        assert loaded.k[0].tolist() == [0.5 + r]
        assert loaded.k[1].tolist() == [0.25 + r, 0.75 + r]
    with pytest.raises(ScalesFileError, match="2 tensor-parallel ranks, the engine runs 4"):
        load_scales_file(path, 2, 4, "fp8_e4m3", tp_rank=0, tp_size=4)
    ranks["1"]["1"] = [1.0] * 4  # the whole model's heads where the rank's 2 belong
    path.write_text(json.dumps({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": ranks}}))
    with pytest.raises(ScalesFileError, match=r"2 KV heads on tp rank 1") as err:
        load_scales_file(path, 2, 4, "fp8_e4m3", tp_rank=1, tp_size=2)
    assert "key kv_cache.scaling_factor.1.1:" in str(err.value)


@HYPOTHESIS
@given(kv_scales(), st.sampled_from([1, 2, 3, 6]))
def test_a_rank_0_file_is_cut_into_contiguous_head_ranges(drawn, tp_size):
    scales, num_kv_heads = drawn
    assume(num_kv_heads % tp_size == 0)
    per_rank = num_kv_heads // tp_size
    shards = [write_and_load(scales, num_kv_heads, scales.fmt_name, r, tp_size) for r in range(tp_size)]
    for layer in range(scales.num_layers):
        for full, cut in ((scales.k[layer], [s.k[layer] for s in shards]),
                          (scales.v[layer], [s.v[layer] for s in shards])):
            if full.numel() == 1:
                assert all(torch.equal(c, full) for c in cut)
            else:
                for r, c in enumerate(cut):
                    assert c.tolist() == full.tolist()[r * per_rank:(r + 1) * per_rank]
    assert all(s.fingerprint() == scales.shard(r, tp_size).fingerprint() for r, s in enumerate(shards))


def test_fewer_kv_heads_than_ranks_replicates_heads():
    scales = KVScales([torch.tensor([1.0, 2.0])], [torch.tensor([3.0])], "fp8_e4m3", "test")
    got = [scales.shard(r, 4).k[0].tolist() for r in range(4)]
    assert got == [[1.0], [1.0], [2.0], [2.0]]
    with pytest.raises(ValueError, match="cannot be split"):
        KVScales([torch.ones(3)], [torch.ones(3)], "fp8_e4m3", "test").shard(0, 2)


# ---------------------------------------------------------------------------------------------------
# KVScales itself


def test_fingerprint_follows_the_bytes_meaning():
    base = KVScales([torch.tensor([0.5, 0.25])], [torch.tensor([0.125])], "fp8_e4m3", "a")
    same = KVScales([torch.tensor([0.5, 0.25])], [torch.tensor([0.125])], "fp8_e4m3", "another source")
    assert base.fingerprint() == same.fingerprint() == base.fingerprint()
    assert len(base.fingerprint()) == 16
    nudged = torch.nextafter(torch.tensor([0.25]), torch.tensor([1.0]))
    different = [
        KVScales([torch.tensor([0.5, float(nudged)])], [torch.tensor([0.125])], "fp8_e4m3", "a"),
        KVScales([torch.tensor([0.5, 0.25])], [torch.tensor([0.125])], "fp8_e5m2", "a"),
        KVScales([torch.tensor([0.5, 0.25])], [torch.tensor([0.125])], "fp8_e4m3", "a", "hadamard"),
        KVScales([torch.tensor([0.125])], [torch.tensor([0.5, 0.25])], "fp8_e4m3", "a"),  # K and V swapped
        KVScales([torch.tensor([0.125, 0.125])], [torch.tensor([0.125])], "fp8_e4m3", "a"),
    ]
    prints = {base.fingerprint()} | {d.fingerprint() for d in different}
    assert len(prints) == len(different) + 1


def test_per_head_and_ones():
    assert not ones(3, "fp8_e4m3").per_head()
    assert ones(3, "fp8_e4m3").source == "default 1.0"
    assert KVScales([torch.ones(1)], [torch.ones(2)], "fp8_e4m3", "t").per_head()


@pytest.mark.parametrize("bad", [{"rotation": "givens"}, {"v": []}])
def test_kvscales_rejects_bad_fields(bad):
    fields = {"k": [torch.ones(1)], "v": [torch.ones(1)], "fmt_name": "fp8_e4m3", "source": "t"} | bad
    with pytest.raises(ValueError):
        KVScales(**fields)


def test_for_format_rejects_non_canonical_names():
    with pytest.raises(ValueError, match="fp8_e4m3fnuz"):
        ones(1, "fp8_e4m3").for_format("fp8")


@HYPOTHESIS
@given(st.floats(min_value=2.0 ** -10, max_value=2.0 ** 10, width=32), st.integers(0, 2 ** 16 - 1))
def test_doubled_scales_make_e4m3fnuz_store_the_values_e4m3fn_stored(amax, seed):
    # The E4M3FNUZ grid is the E4M3FN grid halved, so x / (2 s) lands on the same code values.
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(64, 1, 8, generator=gen) * 2 - 1) * amax
    fn = KVScales([torch.tensor([amax / 448.0])], [torch.ones(1)], "fp8_e4m3", "t")
    fnuz = fn.for_format("fp8_e4m3fnuz")
    fmt_fn, fmt_fnuz = formats.FP8_FORMATS["fp8_e4m3"], formats.FP8_FORMATS["fp8_e4m3fnuz"]
    via_fn = reference.dequantize(reference.quantize(x, fn.k[0], fmt_fn), fn.k[0], fmt_fn, head_dim=1)
    via_fnuz = reference.dequantize(reference.quantize(x, fnuz.k[0], fmt_fnuz), fnuz.k[0], fmt_fnuz, head_dim=1)
    assert torch.equal(via_fn.abs(), via_fnuz.abs())  # magnitudes: E4M3FNUZ has no -0


# ---------------------------------------------------------------------------------------------------
# checkpoint scales

CHECKPOINT_CONVENTIONS = {
    "tgi": lambda i: {f"model.layers.{i}.self_attn.kv_scale": ("k", "v")},
    "llm-compressor": lambda i: {f"model.layers.{i}.self_attn.k_scale": ("k",),
                                 f"model.layers.{i}.self_attn.v_scale": ("v",)},
    "compressed-tensors": lambda i: {f"model.layers.{i}.self_attn.k_proj.output_scale": ("k",),
                                     f"model.layers.{i}.self_attn.v_proj.output_scale": ("v",)},
}


def unrelated_tensors(num_layers: int) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.randn(4, 4)}
    for i in range(num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{proj}.weight"] = torch.randn(4, 4)
            out[f"model.layers.{i}.self_attn.{proj}.input_scale"] = torch.tensor(7.0)  # linear input, not KV
            out[f"model.layers.{i}.self_attn.{proj}.weight_scale"] = torch.tensor(9.0)
    return out


def checkpoint(convention: str, num_layers: int, num_kv_heads: int, seed: int = 0,
               shape_of=lambda i, n: (n,) if i % 2 else ()) -> tuple[dict, list, list]:
    gen = torch.Generator().manual_seed(seed)
    tensors = unrelated_tensors(num_layers)
    k, v = [None] * num_layers, [None] * num_layers
    for i in range(num_layers):
        for name, kinds in CHECKPOINT_CONVENTIONS[convention](i).items():
            value = torch.rand(shape_of(i, num_kv_heads), generator=gen) + 0.01
            tensors[name] = value
            for kind in kinds:
                (k if kind == "k" else v)[i] = value.reshape(-1).to(torch.float32)
    return tensors, k, v


@pytest.mark.parametrize("convention", CHECKPOINT_CONVENTIONS)
def test_checkpoint_scales_of_every_convention(convention):
    tensors, k, v = checkpoint(convention, num_layers=4, num_kv_heads=3)
    scales = scales_from_checkpoint(tensors, 4, 3, None, "fp8_e4m3")
    assert scales.source == "checkpoint" and scales.fmt_name == "fp8_e4m3"
    assert_same_values(k, scales.k)
    assert_same_values(v, scales.v)
    assert scales.per_head()


@pytest.mark.parametrize("prefix", ["", "model.", "language_model.model."])
def test_checkpoint_names_with_other_prefixes(prefix):
    tensors = {f"{prefix}layers.{i}.self_attn.{kind}_scale": torch.tensor([0.5 + i]) for i in range(2)
               for kind in "kv"}
    scales = scales_from_checkpoint(tensors, 2, 1, None, "fp8_e4m3")
    assert [t.tolist() for t in scales.k] == [[0.5], [1.5]]


def test_checkpoint_without_kv_scales_gives_none():
    assert scales_from_checkpoint(unrelated_tensors(3), 3, 2, None, "fp8_e4m3") is None


def test_bfloat16_checkpoint_scales_become_float32():
    tensors = {f"model.layers.0.self_attn.{kind}_scale": torch.tensor(0.375, dtype=torch.bfloat16)
               for kind in "kv"}
    scales = scales_from_checkpoint(tensors, 1, 1, None, "fp8_e4m3")
    assert scales.k[0].dtype == torch.float32 and scales.k[0].tolist() == [0.375]


@pytest.mark.parametrize("config, cache, factor", [
    (None, "fp8_e4m3fnuz", 2.0),  # no dtype in config.json: made for E4M3FN
    ({"kv_cache_torch_dtype": "float8_e4m3fnuz"}, "fp8_e4m3", 0.5),
    ({"kv_cache_torch_dtype": "torch.float8_e4m3fn"}, "fp8_e4m3fnuz", 2.0),
    ({"quantization_config": {"kv_cache_torch_dtype": "float8_e4m3fnuz"}}, "fp8_e4m3fnuz", 1.0),
    ({"kv_cache_torch_dtype": "float8_e5m2"}, "fp8_e4m3", 1.0),
])
def test_checkpoint_scales_convert_to_the_cache_format(config, cache, factor):
    tensors, k, v = checkpoint("llm-compressor", 2, 2)
    scales = scales_from_checkpoint(tensors, 2, 2, config, cache)
    assert scales.fmt_name == cache
    assert_same_values(k, scales.k, factor)
    assert_same_values(v, scales.v, factor)


def drop(tensors: dict, *names: str) -> None:
    for name in names:
        del tensors[name]


CHECKPOINT_ERRORS = {
    "a layer without scales": (lambda t: drop(t, "model.layers.2.self_attn.k_scale",
                                              "model.layers.2.self_attn.v_scale"), "k of layer 2"),
    "K without V": (lambda t: drop(t, "model.layers.1.self_attn.v_scale"), "v of layer 1"),
    "zero": (lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}),
             "model.layers.0.self_attn.k_scale"),
    "negative": (lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor([-1.0])}),
                 "model.layers.0.self_attn.k_scale"),
    "nan": (lambda t: t.update({"model.layers.1.self_attn.v_scale": torch.tensor([0.5, float("nan")])}),
            "model.layers.1.self_attn.v_scale"),
    "inf": (lambda t: t.update({"model.layers.1.self_attn.v_scale": torch.tensor(float("inf"))}),
            "model.layers.1.self_attn.v_scale"),
    "wrong head count": (lambda t: t.update({"model.layers.1.self_attn.v_scale": torch.ones(3)}),
                         "model.layers.1.self_attn.v_scale"),
    "layer beyond the model": (lambda t: t.update({"model.layers.9.self_attn.v_scale": torch.ones(1)}),
                               "model.layers.9.self_attn.v_scale"),
    "two conventions disagree": (lambda t: t.update({"model.layers.0.self_attn.kv_scale": torch.tensor(3.0)}),
                                 "model.layers.0.self_attn.kv_scale"),
}


@pytest.mark.parametrize("case", CHECKPOINT_ERRORS, ids=str)
def test_bad_checkpoint_scales_are_named(case):
    mutate, named = CHECKPOINT_ERRORS[case]
    tensors, _, _ = checkpoint("llm-compressor", 3, 2)
    scales_from_checkpoint(tensors, 3, 2, None, "fp8_e4m3")  # the base is valid
    mutate(tensors)
    with pytest.raises(CheckpointScalesError) as err:
        scales_from_checkpoint(tensors, 3, 2, None, "fp8_e4m3")
    assert named in str(err.value)
    assert "--quantization-param-path" in str(err.value)


def test_unknown_checkpoint_dtype():
    tensors, _, _ = checkpoint("tgi", 1, 1)
    with pytest.raises(CheckpointScalesError, match="kv_cache_torch_dtype"):
        scales_from_checkpoint(tensors, 1, 1, {"kv_cache_torch_dtype": "int8"}, "fp8_e4m3")


# ---------------------------------------------------------------------------------------------------
# precedence: file > checkpoint > calculate > 1.0


def resolve(tmp_path, *, file=False, ckpt=False, calculate=False, kv_cache_dtype="fp8_e4m3", tp_size=1):
    warnings: list[str] = []
    path = None
    if file:
        path = tmp_path / "scales.json"
        write_scales_file(path, KVScales([torch.full((2,), 0.5)] * 3, [torch.full((2,), 0.25)] * 3,
                                         "fp8_e4m3", "t"), "llama", 2)
    tensors = checkpoint("llm-compressor", 3, 2)[0] if ckpt else unrelated_tensors(3)
    got = resolve_scales(kv_cache_dtype, 3, 2, path, tensors, None, calculate, 0, tp_size, warnings.append)
    return got, warnings


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("calculate", [False, True])
def test_a_file_wins_over_everything(tmp_path, ckpt, calculate):
    got, warnings = resolve(tmp_path, file=True, ckpt=ckpt, calculate=calculate)
    assert got.source == f"file {tmp_path / 'scales.json'}"
    assert got.k[0].tolist() == [0.5, 0.5]
    assert len(warnings) == ckpt + calculate  # each overridden source is mentioned


@pytest.mark.parametrize("calculate", [False, True])
def test_checkpoint_wins_over_calculate(tmp_path, calculate):
    got, warnings = resolve(tmp_path, ckpt=True, calculate=calculate)
    assert got.source == "checkpoint"
    assert len(warnings) == calculate


def test_checkpoint_scales_are_cut_for_the_rank(tmp_path):
    got, _ = resolve(tmp_path, ckpt=True, tp_size=2)  # rank 0 of 2: the first of 2 KV heads
    full, _ = resolve(tmp_path, ckpt=True)
    assert full.per_head()
    assert [t.tolist() for t in got.k] == [t.tolist()[:1] for t in full.k]


def test_calculate_asks_the_caller_to_compute(tmp_path):
    got, warnings = resolve(tmp_path, calculate=True)
    assert got is None and warnings == []


def test_nothing_gives_ones_with_a_warning_naming_the_flags(tmp_path):
    got, warnings = resolve(tmp_path)
    assert got.source == "default 1.0"
    assert all(t.tolist() == [1.0] for t in got.k + got.v)
    assert len(warnings) == 1
    assert "--quantization-param-path" in warnings[0] and "--calculate-kv-scales" in warnings[0]


def test_auto_cache_needs_no_scales(tmp_path):
    got, warnings = resolve(tmp_path, file=True, ckpt=True, kv_cache_dtype="auto")
    assert got.source == "unused (auto cache)" and warnings == []


def test_a_bad_file_stops_even_when_the_checkpoint_has_scales(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ScalesFileError):
        resolve_scales("fp8_e4m3", 3, 2, path, checkpoint("tgi", 3, 2)[0], warn=lambda m: None)


# ---------------------------------------------------------------------------------------------------
# computed scales


@HYPOTHESIS
@given(st.sampled_from(FORMAT_NAMES), st.integers(1, 4), st.floats(1e-3, 1e4), st.integers(0, 2 ** 16 - 1))
def test_computed_scales_map_each_heads_maximum_onto_the_formats_largest_value(name, heads, spread, seed):
    fmt = formats.FP8_FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(16, heads, 8, generator=gen) * spread * (torch.rand(1, heads, 1, generator=gen) + 0.01)
            for _ in range(2)]
    amax = [k.abs().amax(dim=(0, 2)) for k in keys]
    per_head = compute_scales(amax, amax, name, "head")
    per_tensor = compute_scales(amax, amax, name, "tensor")
    assert per_head.source == "calculated from the first batch" and per_head.fmt_name == name
    for k, a, s_head, s_tensor in zip(keys, amax, per_head.k, per_tensor.k):
        assert s_head.shape == (heads,) and s_tensor.shape == (1,)
        assert torch.equal(s_tensor, a.max().reshape(1) / fmt.max)
        # the largest magnitude (per head, or over heads) is stored as the format's largest value
        stored = reference.dequantize(reference.quantize(k, s_head, fmt), s_head, fmt, head_dim=1)
        assert torch.equal(stored.abs().amax(dim=(0, 2)), fmt.max * s_head)
        stored = reference.dequantize(reference.quantize(k, s_tensor, fmt), s_tensor, fmt, head_dim=1)
        assert torch.equal(stored.abs().amax().reshape(1), fmt.max * s_tensor)


def test_zero_activations_give_a_small_positive_scale():
    scales = compute_scales([torch.zeros(3)], [torch.zeros(3)], "fp8_e4m3", "head")
    assert bool((scales.k[0] > 0).all())
    fmt = formats.FP8_FORMATS["fp8_e4m3"]
    codes = reference.quantize(torch.zeros(4, 3, 8), scales.k[0], fmt)
    assert torch.equal(reference.dequantize(codes, scales.k[0], fmt, 1), torch.zeros(4, 3, 8))


@pytest.mark.parametrize("args, match", [
    (([torch.ones(2)], [torch.ones(2)], "fp8_e4m3", "channel"), "granularity"),
    (([torch.ones(2)], [torch.ones(2)], "auto", "tensor"), "auto"),
    (([torch.tensor([1.0, float("nan")])], [torch.ones(2)], "fp8_e4m3", "head"), "layer 0"),
    (([torch.ones(2)], [], "fp8_e4m3", "head"), "as many"),
])
def test_compute_scales_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        compute_scales(*args)


# ---------------------------------------------------------------------------------------------------
# bad files fail before the model loads: every command and LLM()


def _deep(path) -> None:
    path.write_text('{"kv_cache": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _scales_for(layers: int, heads: int, fmt: str, value: float = 0.5):
    return KVScales([torch.full((heads,), value)] * layers, [torch.full((heads,), value)] * layers, fmt, "t")


EARLY_CASES = {  # name -> (make the file for the tiny model: 2 layers, 2 KV heads; words the error must hold)
    "nested too deeply": (_deep, "nested too deeply"),
    "FIFO": (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),
    "e5m2 scales on an e4m3 cache": (lambda p: write_scales_file(p, _scales_for(2, 2, "fp8_e5m2"), "llama", 2),
                                     "made for float8_e5m2"),
    "a scale of 1e38": (lambda p: p.write_text(json.dumps({"kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5, "1": 1e38}}}})), "outside"),
    "layers of another model": (lambda p: write_scales_file(p, _scales_for(3, 2, "fp8_e4m3"), "llama", 2),
                                "the file has 3 layers, the model 2"),
}


def _model_never_loads(*args, **kwargs):
    raise AssertionError("the model was loaded before the scales file was checked")


def _flat(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines


@pytest.mark.parametrize("command", ["run", "generate", "eval"])
@pytest.mark.parametrize("case", EARLY_CASES, ids=str)
def test_commands_refuse_a_bad_scales_file_before_loading_the_model(tiny_llama_path, tmp_path, monkeypatch,
                                                                     command, case):
    from click.testing import CliRunner

    import fp8cache.quality.eval
    import fp8cache.server.serve
    from fp8cache.engine.llm import LLM
    from launcher.cli import main

    monkeypatch.setattr(fp8cache.server.serve, "serve", _model_never_loads)
    monkeypatch.setattr(LLM, "from_config", _model_never_loads)
    monkeypatch.setattr(fp8cache.quality.eval, "evaluate", _model_never_loads)
    make, words = EARLY_CASES[case]
    path = tmp_path / "scales.json"
    make(path)
    args = [command, tiny_llama_path, *(["hello"] if command == "generate" else []), "--kv-cache-dtype", "fp8_e4m3",
            "--quantization-param-path", str(path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert str(path) in result.output.replace("\n", "") and words in _flat(result.output)


@pytest.mark.parametrize("case", EARLY_CASES, ids=str)
def test_llm_refuses_a_bad_scales_file_before_loading_the_model(tiny_llama_path, tmp_path, monkeypatch, case):
    import fp8cache.engine.llm as llm_module

    monkeypatch.setattr(llm_module, "LLMEngine", _model_never_loads)
    make, words = EARLY_CASES[case]
    path = tmp_path / "scales.json"
    make(path)
    with pytest.raises(ScalesFileError) as err:
        llm_module.LLM(model=tiny_llama_path, kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path))
    assert str(path) in str(err.value) and words in str(err.value)


def test_the_early_check_knows_the_default_models_shape(default_model_path, tmp_path, monkeypatch):
    import fp8cache.engine.llm as llm_module
    from fp8cache.model.loader import read_config_dict

    monkeypatch.setattr(llm_module, "LLMEngine", _model_never_loads)
    layers = read_config_dict(default_model_path)["num_hidden_layers"]
    path = tmp_path / "scales.json"
    write_scales_file(path, _scales_for(layers + 1, 1, "fp8_e4m3"), "llama", 1)
    with pytest.raises(ScalesFileError, match=f"the file has {layers + 1} layers, the model {layers}"):
        llm_module.LLM(kv_cache_dtype="fp8", quantization_param_path=str(path))  # no model: the default one
