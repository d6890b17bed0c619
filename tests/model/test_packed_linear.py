"""Linear layers packed for oneDNN or fp8kv's float32 / bfloat16 panels (fp8cache.model.cpu.packed_linear) against
F.linear."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8cache import ops
from fp8cache.config import EngineConfig
from fp8cache.model.cpu import packed_linear
from fp8cache.model.loader import load_model

pytestmark = pytest.mark.skipif(not packed_linear.packing_works(torch.bfloat16),
                                reason="this torch build cannot pack bfloat16 weights for oneDNN")


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float32_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(576, 192, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(192, 576, generator=g) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(192, generator=g))
    x = torch.randn(1, rows, 576, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), linear.weight.float(), linear.bias.float() if bias else None)
    with torch.no_grad():
        got = packed_linear.PackedLinear(linear)(x)
    assert got.shape == (1, rows, 192) and got.dtype == torch.bfloat16
    # bfloat16 output: within two of its ulps of the float32 result
    assert ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-2).all()


def test_pack_linears_keeps_the_model_output(tiny_llama_path):
    config = EngineConfig(model=tiny_llama_path, dtype="bfloat16")
    plain, packed = (load_model(config, progress=False).model for _ in range(2))
    linears = sum(type(m) is nn.Linear for m in packed.modules())
    assert packed_linear.pack_linears(packed, torch.device("cpu")) == linears > 0
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert packed_linear.pack_linears(packed, torch.device("cpu")) == 0  # a second runner on the same model
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 11]])
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits.float(), packed(input_ids=ids).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    q_proj = packed.model.layers[0].self_attn.q_proj
    assert q_proj.weight.shape == plain.model.layers[0].self_attn.q_proj.weight.shape
    assert q_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("compiled_ops", [False, True], ids=["onednn", "panels"])
@pytest.mark.parametrize("pays", [False, True])
def test_float32_models_are_packed_where_the_probe_finds_it_faster(tiny_llama_path, monkeypatch, pays, compiled_ops):
    plain, fp32 = (load_model(EngineConfig(model=tiny_llama_path, dtype="float32"), progress=False).model
                   for _ in range(2))
    probed = []
    monkeypatch.setattr(packed_linear, "packing_pays", lambda shapes, panels: probed.append((shapes, panels)) or pays)
    if compiled_ops:
        ops.load()
    else:  # as in a process without the op library
        monkeypatch.setattr(packed_linear, "cpu_features", lambda: packed_linear.CpuFeatures("", False, False))
    linears = sum(type(m) is nn.Linear for m in fp32.modules())
    assert packed_linear.pack_linears(fp32, torch.device("cpu")) == (linears if pays else 0)
    panels = compiled_ops and torch.ops.fp8kv.cpu_isa() in ("avx512", "avx2")
    q_proj = fp32.model.layers[0].self_attn.q_proj
    assert probed and (tuple(q_proj.weight.shape) in probed[0][0]) and probed[0][1] == panels
    packed = [m for m in fp32.modules() if isinstance(m, packed_linear.PackedLinear)]
    assert all(m.panels == panels for m in packed) and bool(packed) == pays
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 11]])
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, fp32(input_ids=ids).logits
    assert got.dtype == torch.float32
    # float32 sums in another order: rounding-level differences only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bfloat16_models_are_packed_without_the_probe(tiny_llama_path, monkeypatch):
    """Only float32 packing is a close call worth measuring; bfloat16 always gains."""
    monkeypatch.setattr(packed_linear, "packing_pays", lambda *a: pytest.fail("bfloat16 needs no probe"))
    model = load_model(EngineConfig(model=tiny_llama_path, dtype="bfloat16"), progress=False).model
    if not packed_linear.packing_works(torch.bfloat16):
        pytest.skip("this torch build or CPU cannot run oneDNN's packed bfloat16 linear")
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert packed_linear.pack_linears(model, torch.device("cpu")) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())


class FakeClock:
    """Time that passes only when a test says so: a measurement against it does not depend on the machine's load
    (these tests raced a real 2 ms sleep against measured times, and failed whenever the machine was busy)."""

    def __init__(self) -> None:
        self.now = 0.0

    def timer(self, call, *args) -> float:
        """probes.best_time on this clock: one untimed call, then the best of three."""
        call(*args)
        best = float("inf")
        for _ in range(3):
            start = self.now
            call(*args)
            best = min(best, self.now - start)
        return best

    def slowed(self, call, seconds: float = 0.002):
        def slow(*args):
            self.now += seconds
            return call(*args)
        return slow


def test_packing_pays_follows_the_measured_times(monkeypatch):
    shapes = frozenset({(64, 48), (48, 64)})
    measure = packed_linear.measure_packing  # the measurement itself, not its memo or its file
    ops.load()
    for panels in (False, True):
        clock = FakeClock()
        monkeypatch.setattr(packed_linear, "_PROBE_MAX_BYTES", 0)  # one copy of each weight: a quicker race
        monkeypatch.setattr(packed_linear.PackedLinear, "forward", clock.slowed(packed_linear.PackedLinear.forward))
        assert not measure(shapes, panels, timer=clock.timer)
        assert clock.now > 0  # the packed layers ran, and only they took time
        monkeypatch.undo()
        clock = FakeClock()
        monkeypatch.setattr(packed_linear, "_PROBE_MAX_BYTES", 0)
        monkeypatch.setattr(packed_linear, "F", SimpleNamespace(linear=clock.slowed(F.linear)))
        assert measure(shapes, panels, timer=clock.timer)
        monkeypatch.undo()


def test_bf16_panels_pay_follows_the_measured_times(monkeypatch):
    """On an AMX CPU, bfloat16 weights go to whichever packing the probe times faster."""
    def slowed_when(clock: FakeClock, panels: bool):
        forward = packed_linear.PackedLinear.forward

        def maybe_slow(self, x):
            if self.panels == panels:
                clock.now += 0.002
            return forward(self, x)
        return maybe_slow

    shapes = frozenset({(64, 48), (48, 64)})
    ops.load()
    for panels in (False, True):
        clock = FakeClock()
        monkeypatch.setattr(packed_linear, "_PROBE_MAX_BYTES", 0)
        monkeypatch.setattr(packed_linear.PackedLinear, "forward", slowed_when(clock, panels))
        assert packed_linear.measure_bf16_panels(shapes, timer=clock.timer) == (not panels)
        monkeypatch.undo()


def test_the_probe_times_with_the_machine_clock_by_default(monkeypatch):
    """Without an injected timer the race times with probes.best_time, the measurement a start makes."""
    monkeypatch.setattr(packed_linear, "_PROBE_MAX_BYTES", 0)
    spent = packed_linear.race([(packed_linear._plain, torch.float32)], frozenset({(32, 16)}))
    assert len(spent) == 1 and 0 < spent[0] < float("inf")


def test_the_probe_streams_decode_batches_over_more_weights_than_the_cache_holds(monkeypatch):
    """A decode step reads its weights from memory: the decode-sized calls run over copies of each weight
    adding up to 1.5x the last-level cache, each called once a pass; the prefill-sized calls reuse one."""
    monkeypatch.setattr(packed_linear, "_last_level_cache_bytes", lambda: 1 << 20)
    seen: dict[int, set[int]] = {}

    def candidate(linear):
        def call(x):
            seen.setdefault(x.shape[0], set()).add(linear.weight.data_ptr())
        return call

    packed_linear.race([(candidate, torch.bfloat16)], frozenset({(128, 256)}))  # 64 KB a copy
    assert len(seen[16]) == (3 << 19) // (128 * 256 * 2) == 24
    assert len(seen[256]) == 1


def test_bf16_panels_pay_is_kept_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    shapes = frozenset({(40, 24)})
    answers = iter([True, False])
    monkeypatch.setattr(packed_linear, "measure_bf16_panels", lambda *a: next(answers))
    packed_linear.bf16_panels_pay.cache_clear()
    try:
        assert packed_linear.bf16_panels_pay(shapes) is True
        packed_linear.bf16_panels_pay.cache_clear()
        assert packed_linear.bf16_panels_pay(shapes) is True  # read back from probes.json, not measured again
    finally:
        packed_linear.bf16_panels_pay.cache_clear()


def test_packing_pays_is_measured_once_per_process(monkeypatch):
    shapes = frozenset({(40, 24)})
    first = packed_linear.packing_pays(shapes)
    monkeypatch.setattr(packed_linear, "best_time", lambda *a, **k: pytest.fail("measured twice"))
    assert packed_linear.packing_pays(shapes) is first


def test_packing_pays_is_measured_once_per_machine(monkeypatch, tmp_path):
    """The answer is kept beside the op library: a new process (here: the memo cleared) reads it back."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path))
    shapes = frozenset({(40, 24), (24, 40)})
    answers = iter([True, False])
    monkeypatch.setattr(packed_linear, "measure_packing", lambda *a: next(answers))
    packed_linear.packing_pays.cache_clear()
    try:
        assert packed_linear.packing_pays(shapes) is True
        packed_linear.packing_pays.cache_clear()
        assert packed_linear.packing_pays(shapes) is True  # read back, not measured again (that says False)
        assert packed_linear.packing_pays(shapes, True) is False  # another question: measured
        assert (tmp_path / "ops" / "probes.json").is_file()
        (tmp_path / "ops" / "probes.json").write_text("{half a file")
        packed_linear.packing_pays.cache_clear()
        monkeypatch.setattr(packed_linear, "measure_packing", lambda *a: False)
        assert packed_linear.packing_pays(shapes) is False  # a damaged file is measured over
    finally:
        packed_linear.packing_pays.cache_clear()


def _siblings(bias: bool, dtype: torch.dtype) -> list[nn.Linear]:
    g = torch.Generator().manual_seed(7)
    linears = [nn.Linear(64, out, bias=bias).to(dtype) for out in (48, 16, 16)]
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.1)
            if bias:
                linear.bias.copy_(torch.randn(linear.out_features, generator=g))
    return linears


@pytest.mark.parametrize("bias", [False, True])
def test_merged_siblings_give_each_its_own_output(bias):
    linears = _siblings(bias, torch.float32)
    merged = packed_linear.MergedLinear(linears)
    slices = [packed_linear.LinearSlice(merged, i, linear) for i, linear in enumerate(linears)]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1, 5, 64, generator=g), torch.randn(1, 5, 64, generator=g)
    with torch.no_grad():
        want = {id(t): [F.linear(t, linear.weight, linear.bias) for linear in linears] for t in (x, y)}
        # siblings in order, a sibling called twice, siblings interleaved over two inputs
        calls = [(x, 0), (x, 1), (x, 2), (x, 0), (x, 0), (y, 1), (x, 2), (y, 2), (y, 0)]
        for t, i in calls:
            got = slices[i](t)
            assert got.shape == (1, 5, linears[i].out_features)
            torch.testing.assert_close(got, want[id(t)][i], rtol=1e-5, atol=1e-5)
        # the same tensor changed in place and asked again: computed again, not served stale
        slices[0](x)
        x.add_(1.0)
        torch.testing.assert_close(slices[0](x), F.linear(x, linears[0].weight, linears[0].bias), rtol=1e-5, atol=1e-5)
        for i in range(1, 3):
            slices[i](x)
    assert merged._output is None and merged._input is None  # nothing held once every sibling had its part
    assert slices[1].weight.shape == linears[1].weight.shape and slices[1].out_features == 16


def test_pack_linears_merges_attention_and_mlp_projections(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(packed_linear, "packing_pays", lambda *a: True)
    config = EngineConfig(model=tiny_llama_path, dtype="float32")
    plain, merged = (load_model(config, progress=False).model for _ in range(2))
    linears = sum(type(m) is nn.Linear for m in merged.modules())
    assert packed_linear.pack_linears(merged, torch.device("cpu")) == linears
    layer = merged.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, packed_linear.MergedLinear)
    assert isinstance(layer.mlp.gate_up_proj, packed_linear.MergedLinear)
    assert all(isinstance(getattr(layer.self_attn, n), packed_linear.LinearSlice) for n in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(layer.self_attn.o_proj, packed_linear.PackedLinear)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 11]])
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# ---- fp8kv's float32 panel kernel (torch.ops.fp8kv.linear_f32) ------------------------------------------

@pytest.mark.parametrize("rows", [0, 1, 7, 8, 16, 29, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (17, 33), (48, 5), (100, 40)])
def test_linear_f32_matches_float32_linear(rows, out_features, in_features):
    """Every micro-kernel shape: full and partial 8-row tiles, groups of 3/2/1 panels, a partial last panel."""
    lib = ops.load()
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, in_features, generator=g)
    packed = lib.linear_f32_pack(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    for b in (None, bias):
        got = lib.linear_f32(x, packed, out_features, b)
        assert got.shape == (1, rows, out_features)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_linear_f32_refuses_bad_inputs():
    lib = ops.load()
    packed = lib.linear_f32_pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="input has 9 features; the weight takes 8"):
        lib.linear_f32(torch.randn(2, 9), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not match 2 panels"):
        lib.linear_f32(torch.randn(2, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        lib.linear_f32(torch.randn(2, 8), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="input must be a float32"):
        lib.linear_f32(torch.randn(2, 8).bfloat16(), packed, 20, None)
    with pytest.raises(RuntimeError, match="weight must be a float32"):
        lib.linear_f32_pack(torch.randn(20, 8).bfloat16())


FEATURES = {  # CPU kinds: (op library path, AVX512-BF16, AMX) -> (float32 kernel, bfloat16 kernel)
    "epyc-zen4-zen5": (("avx512", True, False), ("panels", "panels")),
    "xeon-amx": (("avx512", True, True), ("panels", "measured")),
    "avx512-without-bf16": (("avx512", False, False), ("panels", "onednn")),
    "avx2": (("avx2", False, False), ("panels", "panels")),
    "portable": (("scalar", False, False), ("onednn", "onednn")),
    "no-op-library": (("", False, False), ("onednn", "onednn")),
}


@pytest.mark.parametrize("kind", FEATURES)
def test_each_cpu_kind_gets_its_linear_kernels(kind):
    features, (f32, bf16) = FEATURES[kind]
    features = packed_linear.CpuFeatures(*features)
    assert packed_linear.linear_kernel(torch.float32, features) == f32
    assert packed_linear.linear_kernel(torch.bfloat16, features) == bf16
    assert packed_linear.linear_kernel(torch.float16, features) == "onednn"


def test_float32_without_panels_packs_for_onednn(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(packed_linear, "packing_pays", lambda *a: True)
    model = load_model(EngineConfig(model=tiny_llama_path, dtype="float32"), progress=False).model
    monkeypatch.setattr(packed_linear, "cpu_features", lambda: packed_linear.CpuFeatures("", False, False))
    assert packed_linear.pack_linears(model, torch.device("cpu")) > 0
    assert not any(m.panels for m in model.modules() if isinstance(m, packed_linear.PackedLinear))


# ---- fp8kv's bfloat16 panel kernel (torch.ops.fp8kv.linear_bf16) ----------------------------------------

@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 29, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (17, 33), (48, 5), (100, 40)])
def test_linear_bf16_rounds_the_float32_linear_once(rows, out_features, in_features):
    """Every micro-kernel shape (8 x 3, 12 x 2, 16 x 1 tiles and their remainders, a partial last panel, an
    odd in_features): the float32 result of the bfloat16 inputs, rounded once to bfloat16."""
    lib = ops.load()
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(1, rows, in_features, generator=g).bfloat16()
    packed = lib.linear_bf16_pack(weight)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
    for b in (None, bias):
        got = lib.linear_bf16(x, packed, out_features, b)
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
        # half a bfloat16 ulp from rounding, plus float32 summation-order differences
        assert ((got.float() - want).abs() <= 2 ** -8 * want.abs() + 1e-4).all()
        exact = lib.linear_bf16(x, packed, out_features, b, True)  # float32_out: the sums, never rounded
        assert exact.shape == got.shape and exact.dtype == torch.float32
        torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(exact.bfloat16(), got)


@pytest.mark.parametrize("kind", list(FEATURES))
def test_a_bfloat16_head_keeps_float32_logits_where_the_panels_run(tiny_llama_path, monkeypatch, kind):
    """The output projection's float32 logits (no bfloat16 ties) wherever the CPU has the panels' dot product;
    elsewhere it stays a bfloat16 linear like the rest."""
    ops.load()
    features = packed_linear.CpuFeatures(*FEATURES[kind][0])
    monkeypatch.setattr(packed_linear, "cpu_features", lambda: features)
    monkeypatch.setattr(packed_linear, "packing_works", lambda dtype: True)
    model = load_model(EngineConfig(model=tiny_llama_path, dtype="bfloat16"), progress=False).model
    hidden = torch.randn(1, 5, model.config.hidden_size).bfloat16()
    with torch.no_grad():
        want = F.linear(hidden.float(), model.get_output_embeddings().weight.float())
        packed_linear.pack_linears(model, torch.device("cpu"))
        head = model.get_output_embeddings()
        expected = (features.isa == "avx512" and features.bf16_dot) or features.isa == "avx2"
        assert packed_linear.float32_logits(torch.bfloat16, features) == expected
        assert not packed_linear.float32_logits(torch.float32, features)
        if isinstance(head, packed_linear.PackedLinear):
            assert head.float32_out == expected
        if expected:
            torch.testing.assert_close(head(hidden), want, rtol=1e-5, atol=1e-4)


def test_linear_bf16_refuses_bad_inputs():
    lib = ops.load()
    packed = lib.linear_bf16_pack(torch.randn(20, 8).bfloat16())
    with pytest.raises(RuntimeError, match="input has 10 features; the weight takes 7 or 8"):
        lib.linear_bf16(torch.randn(2, 10).bfloat16(), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not match 2 panels"):
        lib.linear_bf16(torch.randn(2, 8).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias must have 20 elements"):
        lib.linear_bf16(torch.randn(2, 8).bfloat16(), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="input must be a bfloat16"):
        lib.linear_bf16(torch.randn(2, 8), packed, 20, None)
    with pytest.raises(RuntimeError, match="weight must be a bfloat16"):
        lib.linear_bf16_pack(torch.randn(20, 8))


@pytest.mark.parametrize("kind,panels_win", [("epyc-zen4-zen5", None), ("xeon-amx", True), ("xeon-amx", False)])
def test_bfloat16_models_follow_the_cpu_kind_and_each_kernel_is_right(tiny_llama_path, monkeypatch, kind, panels_win):
    """A forced feature set picks its kernel (on an AMX CPU: whichever the probe measured faster; the panels'
    portable path runs on any CPU), and either kernel gives transformers' logits within bfloat16 rounding."""
    ops.load()
    if not packed_linear.packing_works(torch.bfloat16):
        pytest.skip("this torch build or CPU cannot run oneDNN's packed bfloat16 linear")
    plain = load_model(EngineConfig(model=tiny_llama_path, dtype="bfloat16"), progress=False).model
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 11]])
    with torch.no_grad():
        want = plain(input_ids=ids).logits.float()
    monkeypatch.setattr(packed_linear, "cpu_features", lambda: packed_linear.CpuFeatures(*FEATURES[kind][0]))
    probed = []
    monkeypatch.setattr(packed_linear, "bf16_panels_pay", lambda shapes: probed.append(shapes) or panels_win)
    panels = panels_win if FEATURES[kind][1][1] == "measured" else FEATURES[kind][1][1] == "panels"
    model = load_model(EngineConfig(model=tiny_llama_path, dtype="bfloat16"), progress=False).model
    assert packed_linear.pack_linears(model, torch.device("cpu")) > 0
    assert bool(probed) == (panels_win is not None)  # the probe runs on AMX CPUs only
    if probed:  # with the model's own shapes
        assert (model.config.intermediate_size, model.config.hidden_size) in probed[0]
    assert packed_linear.panels_available(torch.bfloat16) == panels
    head = model.get_output_embeddings()
    assert all(m.panels == panels for m in model.modules() if isinstance(m, packed_linear.PackedLinear) and m is not head)
    assert head.float32_out and head.panels  # both kinds have the panels' dot product: float32 logits
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
