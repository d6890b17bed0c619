"""Linear layers with their weights stored once in a blocked layout a CPU kernel streams well.

A decode step multiplies a few rows by every weight of the model. `F.linear` hands oneDNN a plain
[out, in] weight on every call; a weight packed once at load, in the blocked layout its AMX /
AVX512-BF16 kernels read, streams from memory faster (measured with the default model's shapes in
bfloat16, 16 rows: all 210 layer matmuls 35 -> 27 ms, lm_head 7.1 -> 5.2 ms). Large batches (prefill) run as fast as before.
The packed copy replaces the module's weight (the plain one is freed), except for an output projection
that shares its weight with the input embeddings (both are kept).

float32 and bfloat16 weights go to fp8kv's own kernels (torch.ops.fp8kv.linear_f32 / linear_bf16 over 16-column
panels, csrc/cpu/linear_f32.cpp and linear_bf16.cpp) on AVX-512 machines with the compiled ops (bfloat16: with
AVX512-BF16 and no AMX), else to oneDNN; float32 only where a probe at load finds it faster than F.linear (MKL's sgemm)
for the model's own shapes. On an AMD EPYC (Zen 5), MKL's sgemm runs at ~200 GFLOP/s and oneDNN's packed
float32 at ~450; fp8kv's kernels match oneDNN at prefill and keep memory busier at decode (default model's 30
layers, 16 rows: float32 12.2 vs 15.2 ms, bfloat16 5.6 vs 9.6 ms). On an Intel Xeon with AMX, oneDNN was
faster than F.linear at decode but up to 20% slower at prefill. Which kernel a dtype gets is decided by the
CPU's features (`linear_kernel`); where they don't decide it (float32: fp8kv's or oneDNN's packing against
MKL's F.linear), a probe measures it once per machine and the answer is cached beside the op library.

Sibling projections that read one input in one forward (q/k/v, gate/up) are packed as one weight
(MergedLinear): one oneDNN call and one pass over the input instead of three or two. Decode-sized batches
gain, prefill does not change (the default model's layer matmuls, 30 layers streamed from memory, 16 rows:
float32 18.7 -> 16.0 ms, bfloat16 11.1 -> 9.2 ms).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp8cache.ops import probes
from fp8cache.ops.probes import best_time
from fp8cache.platform import cpu_info

# oneDNN picks its blocking for this many rows; decode batches are what the packing is for.
_BATCH_HINT = 16
# (merged module name, sibling projections that every forward calls on the same input)
MERGED_GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


class PackedLinear(nn.Module):
    """nn.Linear's forward over a packed weight: fp8kv's float32 or bfloat16 panels (`panels`) or oneDNN's
    layout. float32_out (bfloat16 panels only): the float32 sums, not rounded to bfloat16."""

    def __init__(self, linear: nn.Linear, panels: bool = False, float32_out: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if float32_out and not (panels and weight.dtype == torch.bfloat16):
            raise ValueError("float32_out needs a bfloat16 weight on fp8kv's panels")
        self.panels, self.float32_out = panels, float32_out
        if panels:
            lib = torch.ops.fp8kv
            pack, self._panel_op = ((lib.linear_bf16_pack, lib.linear_bf16.default) if weight.dtype == torch.bfloat16
                                    else (lib.linear_f32_pack, lib.linear_f32.default))
            packed = pack(weight)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        # Shape and dtype for code that inspects `weight`; it holds no values (the packed copy does).
        self.register_buffer("weight", torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_out:
            return self._panel_op(x, self.packed_weight, self.out_features, self.bias, True)
        if self.panels:
            return self._panel_op(x, self.packed_weight, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={'fp8kv panels' if self.panels else 'oneDNN'}"
                + (", float32 output" if self.float32_out else ""))


class MergedLinear(nn.Module):
    """Sibling projections packed as one weight. Each sibling becomes a LinearSlice: the first slice called
    on an input computes every sibling's output at once, the others take their columns of it."""

    def __init__(self, linears: list[nn.Linear], panels: bool = False) -> None:
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        whole = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device="meta")
        whole.weight = nn.Parameter(weight, requires_grad=False)
        if whole.bias is not None:
            whole.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
        self.packed = PackedLinear(whole, panels)
        ends = torch.tensor([linear.out_features for linear in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._taken: set[int] = set()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or index in self._taken:  # a new input, or this sibling called again
            self._input, self._output, self._taken = x, self.packed(x), set()
        self._taken.add(index)
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        if len(self._taken) == len(self.bounds):  # every sibling served: hold no activation between steps
            self._input = self._output = None
        return out


class LinearSlice(nn.Module):
    """One sibling's columns of a MergedLinear, where its nn.Linear was."""

    def __init__(self, merged: MergedLinear, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.index = index
        self._merged = (merged,)  # a tuple: the parent module owns (and registers) the MergedLinear
        self.register_buffer("weight", torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._merged[0].part(self.index, x)


def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build packs and runs a `dtype` weight to F.linear's result (oneDNN with bfloat16
    support is missing from some builds and CPUs)."""
    try:
        generator = torch.Generator().manual_seed(0)
        linear = nn.Linear(64, 48, bias=True).to(dtype)
        x = torch.randn(1, 5, 64, generator=generator).to(dtype)
        with torch.no_grad():
            got, want = PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Replace the nn.Linear modules of a bfloat16 or float32 CPU model by PackedLinear (float32 only where
    packing_pays); returns how many were. fp8kv's panels where linear_kernel picks them for this CPU (never
    without the op library), else oneDNN's layout. A bfloat16 model's output projection keeps float32 logits
    where the CPU has the panels' dot product (float32_logits)."""
    if device.type != "cpu":
        return 0
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype in (torch.bfloat16, torch.float32)]
    dtypes = {getattr(parent, name).weight.dtype for parent, name in targets}
    if len(dtypes) != 1:
        return 0
    shapes = frozenset(tuple(getattr(parent, name).weight.shape) for parent, name in targets)
    panels = panels_available(*dtypes, shapes)
    if not panels and not packing_works(*dtypes):
        return 0
    if dtypes == {torch.float32} and not packing_pays(shapes, panels):
        return 0
    count = len(targets)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        targets = _merge_siblings(targets, panels)
        for parent, name in targets:
            linear = getattr(parent, name)
            logits_f32 = linear is head and float32_logits(linear.weight.dtype)
            setattr(parent, name, PackedLinear(linear, panels or logits_f32, float32_out=logits_f32))
    _return_freed_memory()
    return count


@dataclass(frozen=True)
class CpuFeatures:
    """What decides the linear kernels: the op library's CPU path (avx512, avx2, scalar; "" without the op
    library), its AVX512-BF16 dot product, and AMX tiles."""

    isa: str
    bf16_dot: bool
    amx: bool


def cpu_features() -> CpuFeatures:
    """This machine's features, as the loaded op library sees them."""
    lib = torch.ops.fp8kv
    if not hasattr(lib, "cpu_isa"):
        return CpuFeatures("", False, _cpu_has_amx())
    return CpuFeatures(lib.cpu_isa(), bool(lib.cpu_bf16_dot()), _cpu_has_amx())


def linear_kernel(dtype: torch.dtype, features: CpuFeatures) -> str:
    """"panels" (fp8kv's kernels), "onednn", or "measured" for `dtype` weights on a CPU with `features`. fp8kv's
    panels need AVX-512 or AVX2 (their portable paths are for correctness, not speed); bfloat16 ones in the
    AVX-512 path also the AVX512-BF16 dot product (AVX2's widen them to float32). With AMX the features do not
    decide bfloat16: oneDNN's AMX kernels streamed decode batches' weights at a quarter of the read bandwidth,
    and the panels run larger batches on AMX tiles too, so bf16_panels_pay measures both ("measured")."""
    if features.isa not in ("avx512", "avx2") or dtype not in (torch.float32, torch.bfloat16):
        return "onednn"
    if features.isa == "avx2":  # its own tiles (panel_tiles_avx2.h): oneDNN streamed decode batches slower
        return "panels"
    if dtype == torch.bfloat16 and not features.bf16_dot:
        return "onednn"
    if dtype == torch.bfloat16 and features.amx:
        return "measured"
    return "panels"


def float32_logits(dtype: torch.dtype, features: CpuFeatures | None = None) -> bool:
    """Whether a `dtype` model's output projection gets float32 logits from fp8kv's bfloat16 panels here.
    Rounded to bfloat16, logits near 16 are 1/8 apart: greedy decoding then ties tokens (the default model
    answered the README's question wrong with an FP8 cache) and a KL against them measures the rounding. The
    panels keep their float32 sums at no cost in bytes read; on an AMX CPU too, where the head's decode-time
    read of its weight outweighs AMX's lead at prefill (only sampled rows reach the head)."""
    features = features or cpu_features()
    return dtype == torch.bfloat16 and ((features.isa == "avx512" and features.bf16_dot) or features.isa == "avx2")


def panels_available(dtype: torch.dtype = torch.float32, shapes: frozenset[tuple[int, int]] = frozenset()) -> bool:
    """fp8kv's panel kernel is what `dtype` weights of these shapes get on this machine (the op library is
    loaded; on an AMX CPU, bfloat16 weights where bf16_panels_pay measures the panels faster)."""
    kernel = linear_kernel(dtype, cpu_features())
    return bf16_panels_pay(shapes) if kernel == "measured" else kernel == "panels"


@functools.cache
def _cpu_has_amx() -> bool:
    return "amx_bf16" in cpu_info.cpu_feature_names()


def _merge_siblings(targets: list[tuple[nn.Module, str]], panels: bool) -> list[tuple[nn.Module, str]]:
    """Pack every MERGED_GROUPS group of `targets` as a MergedLinear; returns the targets left."""
    left = set(targets)
    for parent in dict.fromkeys(parent for parent, _ in targets):
        for merged_name, names in MERGED_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all((parent, name) in left for name in names) or hasattr(parent, merged_name):
                continue
            if len({(x.in_features, x.weight.dtype, x.bias is None) for x in linears}) != 1:
                continue
            merged = MergedLinear(linears, panels)
            parent.add_module(merged_name, merged)
            for index, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, LinearSlice(merged, index, linear))
                left.discard((parent, name))
    return [target for target in targets if target in left]


# Rows of the probe's prefill-like call; its time is counted per _BATCH_HINT rows, so decode and prefill
# tokens weigh alike.
_PROBE_ROWS = 256
# Larger weights (an LM head) make the probe slow and tell nothing the layer shapes do not.
_PROBE_MAX_WEIGHT = 1 << 22
# Bytes of weights the decode-sized probe streams per shape at most (1.5x the last-level cache where that is less).
_PROBE_MAX_BYTES = 128 << 20
_PROBE_MAX_COPIES = 64  # small shapes stream less: they would take thousands of calls


@functools.cache
def packing_pays(shapes: frozenset[tuple[int, int]], panels: bool = False) -> bool:
    """Whether packed float32 weights (fp8kv's panels or oneDNN's layout) multiply faster than F.linear on this
    machine for these (out_features, in_features) shapes. Measured once per machine (the answer is kept in
    probes.json beside the op library, keyed by the CPU, torch and the shapes) and memoized per process:
    runners of one model must not differ by a close call, and a start should not pay for the probe again."""
    # "streamed weights" names the measurement (race's): an answer kept by a release that timed cache-resident
    # weights is not read back, but measured again.
    return probes.remembered(["float32 packing pays", "streamed weights", panels, sorted(shapes)],
                             lambda: measure_packing(shapes, panels))


# A timer: seconds of call(*args) (probes.best_time; the tests give one that reads an injected clock).
Timer = Callable[..., float]


def measure_packing(shapes: frozenset[tuple[int, int]], panels: bool = False, timer: Timer = best_time) -> bool:
    """packing_pays's measurement: packed against F.linear (see race)."""
    plain, packed = race([(_plain, torch.float32), (lambda linear: PackedLinear(linear, panels), torch.float32)],
                         shapes, timer)
    return packed < plain


@functools.cache
def bf16_panels_pay(shapes: frozenset[tuple[int, int]]) -> bool:
    """Whether fp8kv's bfloat16 panels (AVX512-BF16 dot products for decode batches, AMX tiles for larger ones)
    beat oneDNN's packed AMX kernels on this AMX CPU for these (out_features, in_features) shapes. Measured once
    per machine and kept, as packing_pays is."""
    return probes.remembered(["bfloat16 panels beat oneDNN", sorted(shapes)], lambda: measure_bf16_panels(shapes))


def measure_bf16_panels(shapes: frozenset[tuple[int, int]], timer: Timer = best_time) -> bool:
    """bf16_panels_pay's measurement: both packings of the same bfloat16 weights (see race)."""
    onednn, panels = race([(lambda linear: PackedLinear(linear, False), torch.bfloat16),
                           (lambda linear: PackedLinear(linear, True), torch.bfloat16)], shapes, timer)
    return panels < onednn


def race(candidates: list, shapes: frozenset[tuple[int, int]], timer: Timer = best_time) -> list[float]:
    """Seconds of each candidate, a (maker of a callable from an nn.Linear, weight dtype) pair, summed over up to
    six of the shapes at a decode-sized and a prefill-sized batch (best of three each, candidates taking turns).
    The decode-sized batch runs over enough copies of each weight to overflow the last-level cache, as a decode
    step streams a model's weights from memory; the prefill-sized one, which multiplies far more than it reads,
    over one."""
    probe = sorted(s for s in shapes if s[0] * s[1] <= _PROBE_MAX_WEIGHT)[:6] or [(512, 512)]
    streamed = min(_PROBE_MAX_BYTES, 3 * _last_level_cache_bytes() // 2)
    generator = torch.Generator().manual_seed(0)
    spent = [0.0] * len(candidates)
    with torch.no_grad():
        for out_features, in_features in probe:
            decode = torch.randn(_BATCH_HINT, in_features, generator=generator)
            prefill = torch.randn(_PROBE_ROWS, in_features, generator=generator)
            runs = []
            for make, dtype in candidates:
                base = nn.Linear(in_features, out_features, bias=False).to(dtype)
                size = base.weight.numel() * base.weight.element_size()
                copies = min(_PROBE_MAX_COPIES, max(1, streamed // size))
                calls = [make(linear) for linear in [base, *(_copy_of(base) for _ in range(copies - 1))]]
                runs.append((calls, decode.to(dtype), prefill.to(dtype)))
            for i, (calls, x_decode, x_prefill) in enumerate(runs):
                spent[i] += timer(lambda x, fns=calls: [fn(x) for fn in fns], x_decode) / len(calls)
                spent[i] += timer(calls[0], x_prefill) * _BATCH_HINT / _PROBE_ROWS
    return spent


def _plain(linear: nn.Linear):
    """F.linear over the module's own weight, as an unpacked layer runs."""
    return lambda x: F.linear(x, linear.weight)


def engine_linear(dtype: torch.dtype):
    """A maker of what pack_linears gives a `dtype` layer on this machine (for measurements): fp8kv's panels
    where linear_kernel picks them, else F.linear (a float32 layer on the panels only where packing pays)."""
    if linear_kernel(dtype, cpu_features()) == "panels":
        return lambda linear: PackedLinear(linear, True)
    return _plain


def _copy_of(linear: nn.Linear) -> nn.Linear:
    copy = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    copy.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
    return copy


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache, as Linux reports it (32 MiB where it does not)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=32 << 20)


def _return_freed_memory() -> None:
    """The plain weights were freed one layer at a time into the C heap, where glibc keeps them (the
    default model in bfloat16: 250 MB more resident than before packing); malloc_trim hands them back."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: its allocator decides
        pass


def merged_siblings(*linears: nn.Module) -> MergedLinear | None:
    """The MergedLinear whose siblings are exactly `linears`, in order, else None."""
    if not all(isinstance(m, LinearSlice) for m in linears):
        return None
    merged = linears[0]._merged[0]
    if any(m._merged[0] is not merged or m.index != i for i, m in enumerate(linears)) or \
            len(merged.bounds) != len(linears):
        return None
    return merged
