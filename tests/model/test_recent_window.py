"""The recent-token window (kv_recent_window): newest tokens' K/V kept in full precision beside the FP8 cache.

Checked against independent references: the `auto` cache and transformers' own generate (a window at least
as long as the sequence must change nothing), and, for window attention itself, a one-shot prefill whose
attention is one dense softmax per row over the step's own K/V, its mask saying which positions each row reads
in full precision (dense_window_logits).
"""

from __future__ import annotations

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.engine.block_manager import BlockManager
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.sampling_params import SamplingParams
from fp8cache.engine.scheduler import Scheduler
from fp8cache.engine.sequence import Sequence
from fp8cache.engine.window_pool import WindowPool
from fp8cache.kvcache import formats, rotation, sizing
from fp8cache.kvcache.sizing import WINDOW_BUDGET_SHARE, plan_cache
from fp8cache.model import attention
from fp8cache.model.batch import SeqChunk, StepBatch, window_slot
from fp8cache.model.forward_context import ForwardContext
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference
from fp8cache.quality.eval import runner_batch, window_batch
from fp8cache.server.app import ModelInfo

BLOCK = 8


# ---- bookkeeping ---------------------------------------------------------------------------------------

def seq_of(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_window_pool_hands_out_distinct_seats_and_takes_them_back():
    pool = WindowPool(window_size=20, num_seats=2, blocks_per_seat=3)
    a, b, c = seq_of(4, "a"), seq_of(4, "b"), seq_of(4, "c")
    pool.take(a)
    pool.take(b)
    assert sorted(a.window_block_table + b.window_block_table) == list(range(6))
    assert pool.num_free_seats == 0
    with pytest.raises(RuntimeError, match="no free recent-window seat"):
        pool.take(c)
    pool.check_invariants([a, b])
    pool.release(a)
    pool.take(c)
    assert c.window_block_table and not a.window_block_table
    pool.check_invariants([b, c])
    pool.release(b)
    pool.release(b)  # a sequence without a seat releases nothing
    assert pool.num_free_seats == 1


def test_prefix_hits_stop_a_window_before_the_prompt_end():
    window = WindowPool(window_size=12, num_seats=4, blocks_per_seat=2)
    bm = BlockManager(num_blocks=32, block_size=BLOCK, window=window)
    first = seq_of(40)
    bm.allocate(first, 40)
    first.num_computed_tokens = 40
    bm.register_computed_blocks(first)
    # Without a window 4 blocks (32 tokens) would hit; the newest 12 tokens must be recomputed: 28 -> 3 blocks.
    second = seq_of(40, "s")
    assert len(bm.lookup_prefix(second)) == 3
    short = seq_of(15, "t")  # shares 15 tokens, fewer than block + window: no hit
    assert bm.lookup_prefix(short) == []
    cached = bm.lookup_prefix(second)
    bm.allocate(second, 40 - 24, cached)
    assert second.window_floor == 24 and len(second.window_block_table) == 2
    bm.free(second)
    bm.free(first)
    assert window.num_free_seats == 4 and bm.num_free_blocks == 32
    bm.check_invariants()


def test_no_free_seat_means_cannot_allocate():
    bm = BlockManager(num_blocks=32, block_size=BLOCK, window=WindowPool(8, 1, 1))
    a, b = seq_of(5, "a"), seq_of(5, "b")
    assert bm.can_allocate(a, 5)
    bm.allocate(a, 5)
    assert not bm.can_allocate(b, 5)
    bm.free(a)
    assert bm.can_allocate(b, 5)


@pytest.mark.parametrize("sinks", [0, 1, 12])
def test_scheduler_maps_only_the_newest_tokens_and_the_sinks_to_the_ring(sinks):
    """Each chunk writes its last `window` positions and the sequence's first `sinks` (attention sinks) to the
    ring, at the seats of the reference's layout."""
    window = 10
    bm = BlockManager(num_blocks=64, block_size=BLOCK, window=WindowPool(window, 2, -(-(window + sinks) // BLOCK),
                                                                       sinks))
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=13)
    seq = seq_of(30)
    sched.add(seq)
    seen = []
    while seq.num_computed_tokens < len(seq):
        plan = sched.schedule()
        chunk, start = plan.batch.seqs[0], seq.num_computed_tokens
        end = start + chunk.query_len
        expected = [int(reference.window_slots(seq.window_block_table, torch.tensor([p]), window, BLOCK, sinks)[0])
                    if p >= end - window or p < sinks else -1 for p in range(start, end)]
        assert plan.batch.window_slot_mapping == expected
        assert chunk.window_block_table == seq.window_block_table
        seen.append(chunk.query_len)
        sched.on_step_done(plan.scheduled)
    assert seen == [13, 13, 4]


def test_plan_counts_the_window_in_the_budget():
    plain = plan_cache(1 << 23, 0.3, 16, 1000)
    windowed = plan_cache(1 << 23, 0.3, 16, 1000, window_size=20, window_token_bytes=4000, max_num_seqs=64)
    seat = 2 * 16 * 4000  # 20 tokens round up to 2 blocks
    assert windowed.window_blocks_per_seat == 2 and windowed.window_bytes == windowed.window_seats * seat
    assert windowed.window_seats == (1 << 23) // WINDOW_BUDGET_SHARE // seat == 4  # capped at a share of the budget
    assert plan_cache(1 << 23, 0.3, 16, 1000, window_size=20, window_token_bytes=4000,
                      max_num_seqs=2).window_seats == 2
    assert windowed.num_blocks == ((1 << 23) - windowed.window_bytes) // (16 * 1000) < plain.num_blocks
    with pytest.raises(ValueError, match="kv_recent_window"):
        plan_cache(seat + 100, 0.3, 16, 1000, window_size=20, window_token_bytes=4000)
    # attention sinks sit in the ring before the recent seats: 12 + 20 tokens still fit 2 blocks, 13 + 20 take 3
    for sinks, blocks in ((12, 2), (13, 3)):
        plan = plan_cache(1 << 23, 0.3, 16, 1000, window_size=20, window_token_bytes=4000, max_num_seqs=2,
                          window_sinks=sinks)
        assert (plan.window_blocks_per_seat, plan.window_sinks) == (blocks, sinks)
        assert plan.window_bytes == 2 * blocks * 16 * 4000
    assert plan_cache(1 << 23, 0.3, 16, 1000, window_sinks=4).window_sinks == 0  # no window, no sinks


def _full_length_batch(plan, max_model_len: int) -> int:
    """Sequences of max_model_len tokens that run at once under `plan`: each needs its blocks and a seat."""
    return min(plan.window_seats, plan.num_blocks // -(-max_model_len // plan.block_size))


@pytest.mark.parametrize("budget,max_model_len,token_bytes,window_token_bytes", [
    (256 << 20, 4096, 11520, 46080),  # the default model: FP8 cache, float32 window, 4k context
    (256 << 20, 4096, 11520, 23040),  # bfloat16 window
    (64 << 20, 8192, 11520, 46080),
    (1 << 30, 512, 11520, 46080),
    (3 << 20, 100, 1000, 4000),
    (6900 << 20, 8192, 11520, 46080),  # `fp8kv run`'s default: max_model_len 8192, a few GB
])
def test_window_seats_cover_full_length_sequences_and_cost_a_small_share(budget, max_model_len, token_bytes, window_token_bytes):
    # Brute force over every seat count: the most max_model_len sequences that can run at once.
    seat = 2 * 16 * window_token_bytes
    best = 0
    for seats in range(1, 257):
        blocks = (budget - seats * seat) // (16 * token_bytes)
        if blocks >= 1:
            best = max(best, min(seats, blocks // -(-max_model_len // 16)))
    plan = plan_cache(budget, 0.3, 16, token_bytes, window_size=32, window_token_bytes=window_token_bytes,
                      max_num_seqs=256, max_model_len=max_model_len)
    # Every full-length sequence that can run has a seat; seats for more (shorter) sequences cost at most
    # 1/WINDOW_BUDGET_SHARE of the budget, so the full-length batch stays within that share of the best.
    assert plan.window_seats >= min(256, best, budget // WINDOW_BUDGET_SHARE // seat)
    assert plan.window_bytes <= max(best * seat, budget // WINDOW_BUDGET_SHARE)
    assert _full_length_batch(plan, max_model_len) >= best * (WINDOW_BUDGET_SHARE - 1) // WINDOW_BUDGET_SHARE
    if plan.window_seats == best:
        assert _full_length_batch(plan, max_model_len) == best


# ---- the model -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_llama_path):
    return load_model(EngineConfig(model=tiny_llama_path), progress=False)


def make_runner(loaded, kv_cache_dtype: str, window: int | None, **overrides) -> ModelRunner:
    log = overrides.pop("log_to", lambda msg: None)
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype,
                          block_size=overrides.pop("block_size", BLOCK),
                          kv_cache_memory=overrides.pop("kv_cache_memory", "16MiB"), kv_recent_window=window,
                          max_num_seqs=overrides.pop("max_num_seqs", 4), **overrides)
    return ModelRunner(config, log=log, loaded=loaded)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (n,), generator=g).tolist()


class RingSeq:
    """One sequence fed step by step through the runner, with blocks [first_block, ...) and ring seat 0."""

    def __init__(self, runner: ModelRunner, ids: list[int], first_block: int = 0, seat: int = 0) -> None:
        self.runner, self.ids = runner, ids
        n_blocks = -(-len(ids) // runner.block_size)
        self.blocks = list(range(first_block, first_block + n_blocks))
        per_seat = runner.cache_plan.window_blocks_per_seat
        self.ring = list(range(seat * per_seat, (seat + 1) * per_seat))

    def chunk(self, start: int, end: int, floor: int = 0) -> StepBatch:
        bs, window, sinks = self.runner.block_size, self.runner.kv_recent_window, self.runner.kv_recent_window_sinks
        batch = StepBatch(token_ids=self.ids[start:end], positions=list(range(start, end)),
                          slot_mapping=[self.blocks[p // bs] * bs + p % bs for p in range(start, end)])
        batch.window_slot_mapping = [window_slot(self.ring, p, window, bs, sinks) if p >= end - window or p < sinks
                                     else -1 for p in range(start, end)]
        batch.seqs.append(SeqChunk(end - start, end, self.blocks[:-(-end // bs)], window_block_table=self.ring,
                                   window_floor=floor))
        return batch


def dense_window_logits(runner: ModelRunner, ids: list[int], floor: int = 0, sinks: int | None = None) -> torch.Tensor:
    """The oracle of window attention: the runner's model over the whole of `ids` in one step, each layer's
    attention one dense softmax per row over [FP8 keys ; full-precision keys] of the step's own K/V, read
    neither from the cache nor through the decode ops. Row i reads position j < full_from(i) as the FP8 cache
    holds it and full_from(i) <= j <= i in the window's dtype, full_from(i) = max(i - window + 1, floor), and
    the attention sinks floor <= j < kv_recent_window_sinks in the window's dtype too (below the floor they came
    from the prefix cache: FP8); without a window every position as the cache holds it. Static scales quantize with the layer's scale,
    dynamic ones with each token and head's own (reference.quantize_dynamic); with a rotation, Q, K and V meet
    in the rotated basis (the matrix product of kvcache.rotation, not the compiled transform) and the output
    rotates back."""
    window = runner.kv_recent_window
    sinks = runner.kv_recent_window_sinks if sinks is None else sinks  # given: the oracle of another setting

    def dense(ctx: ForwardContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
              features: attention.LayerFeatures = attention.PLAIN) -> torch.Tensor:
        assert ctx.calculate_scales is None and features.plain
        fmt = formats.get_format(ctx.layer_formats[layer], "cpu")
        if ctx.rotation != "none":
            h = rotation.rotation_matrix(ctx.rotation, q.shape[-1])
            q, k, v = (rotation.rotate(t, h) for t in (q, k, v))

        def as_cached(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [T, kv_heads, d] as read back
            if fmt is None:
                return x.float()
            if ctx.scale_caches is not None:
                codes, token_scales = reference.quantize_dynamic(x, fmt)
                return codes.view(fmt.torch_dtype).float() * token_scales.float()[..., None]
            return reference.dequantize(reference.quantize(x, scale, fmt), scale, fmt, head_dim=1)

        rows = torch.arange(q.shape[0])[:, None]
        positions = torch.arange(q.shape[0])[None, :]
        keys, values = as_cached(k, ctx.k_scales[layer]), as_cached(v, ctx.v_scales[layer])
        mask = positions <= rows
        if window:
            full_from = torch.clamp(rows - window + 1, min=floor)
            full = (positions <= rows) & ((positions >= full_from) | ((positions < sinks) & (positions >= floor)))
            mask = torch.cat([(positions <= rows) & ~full, full], 1)
            dtype = ctx.window_caches[0][0].dtype
            keys, values = torch.cat([keys, k.to(dtype).float()]), torch.cat([values, v.to(dtype).float()])
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
            scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(0, 1).to(q.dtype)
        if ctx.rotation != "none":
            out = rotation.rotate(out, h)
        return out.contiguous()  # the fused layer views attend's output

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "attend", dense)
        return runner.execute(RingSeq(runner, ids).chunk(0, len(ids), floor=floor), all_logits=True)


def merged(batches: list[StepBatch]) -> StepBatch:
    """One step holding every batch's sequences, in order."""
    step = StepBatch()
    for b in batches:
        step.token_ids += b.token_ids
        step.positions += b.positions
        step.slot_mapping += b.slot_mapping
        step.window_slot_mapping += b.window_slot_mapping
        step.seqs += b.seqs
    return step


@pytest.mark.parametrize("kv_cache_dtype,window,window_dtype,sinks", [
    ("fp8_e4m3", 8, "auto", 1), ("fp8_e5m2", 13, "auto", 0), ("fp8_e4m3", 1, "auto", 1),
    ("fp8_e4m3", 8, "bfloat16", 1), ("fp8_e5m2", 13, "float16", 3), ("fp8_e4m3", 8, "auto", 20)])
def test_chunked_prefill_and_decode_read_the_window_like_one_prefill(loaded, kv_cache_dtype, window,
                                                                     window_dtype, sinks):
    """Feeding a sequence in chunks and then token by token (ring writes, ring reads, window decode op)
    gives the logits of one dense-mask prefill of the whole sequence, where row i reads i-N+1..i and the
    sequence's first `sinks` positions in full precision (in the window's dtype)."""
    ids = prompt_ids(60)
    runner = make_runner(loaded, kv_cache_dtype, window, kv_recent_window_dtype=window_dtype,
                         kv_recent_window_sinks=sinks)
    want = dense_window_logits(runner, ids)
    if sinks:  # the sinks are what the rows past the window read differently
        assert (want - dense_window_logits(runner, ids, sinks=0)).abs().amax() > 1e-4
    seq = RingSeq(runner, ids)
    got = [runner.execute(seq.chunk(0, 11), all_logits=True), runner.execute(seq.chunk(11, 40), all_logits=True)]
    got += [runner.execute(seq.chunk(p, p + 1)) for p in range(40, 60)]
    torch.testing.assert_close(torch.cat(got), want, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def one_layer(make_tiny_model):
    return load_model(EngineConfig(model=make_tiny_model(num_hidden_layers=1)), progress=False)


@pytest.mark.parametrize("window", [1, 8, 13, 40])
def test_cpu_window_prefills_equal_one_dense_softmax(one_layer, window):
    """The prefill's window attention, rows of the compiled decode op (RowQueries), gives the logits of one
    SDPA with a dense mask over [FP8 keys ; full-precision keys] (dense_window_logits): fresh prompts, later
    chunks, single tokens, and a sequence whose first 32 positions came from another's blocks (window floor
    32). One layer: with two, the first layer's rounding-level differences can flip an FP8 code of the
    second's keys (a 1e-4 change in the logits)."""
    ids = prompt_ids(60, seed=3)
    other = ids[:32] + prompt_ids(28, seed=4)
    runner = make_runner(one_layer, "fp8_e4m3", window)
    want = torch.cat([dense_window_logits(runner, ids), dense_window_logits(runner, other, floor=32)[32:]])
    first = RingSeq(runner, ids)
    logits = [runner.execute(first.chunk(a, b), all_logits=True) for a, b in ((0, 23), (23, 24), (24, 60))]
    shared = RingSeq(runner, other, first_block=len(first.blocks), seat=1)
    shared.blocks[:32 // BLOCK] = first.blocks[:32 // BLOCK]  # a prefix-cache hit: FP8 only
    logits += [runner.execute(shared.chunk(a, b, floor=32), all_logits=True) for a, b in ((32, 45), (45, 60))]
    torch.testing.assert_close(torch.cat(logits), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_scales,kv_rotation,window,block,sinks", [
    ("static", "none", 8, 16, 1),  # a ring block longer than the window: ring slots 1 + p % 8 of one 16-slot block
    ("dynamic", "none", 8, 16, 0), ("dynamic", "hadamard", 32, 16, 1), ("static", "hadamard", 32, 8, 4),
    ("dynamic", "none", 13, 8, 1),
    ("dynamic", "none", 13, 8, 20)])  # sinks past the prefix hit's floor (16): those the sequence computes itself
def test_decode_prefill_chunks_and_prefix_hits_read_what_the_design_says(one_layer, kv_scales, kv_rotation, window,
                                                                         block, sinks):
    """Row i reads positions [max(i - W + 1, floor), i] and the sinks [floor, S) in full precision and older ones
    from FP8, whichever way the sequence reaches the cache (docs/design.md "Recent-token window"): one prefill,
    chunks ending on and off block edges then decode, token by token from the first token, and a prefix-cache
    hit (floor = the shared blocks' end: their K/V exist only as FP8, and the engine fills the sink seats below
    it from there) followed by chunks and decode. Each equals the dense oracle of the same semantics, with
    static and dynamic scales, with and without the rotation."""
    n, shared = 70, 2 * block
    ids, other = prompt_ids(n, seed=7), prompt_ids(n, seed=7)[:shared] + prompt_ids(n - shared, seed=8)
    runner = make_runner(one_layer, "fp8_e4m3", window, block_size=block, kv_scales=kv_scales,
                         kv_rotation=kv_rotation, kv_recent_window_sinks=sinks)
    want = dense_window_logits(runner, ids)
    want_shared = dense_window_logits(runner, other, floor=shared)[shared:]
    paths = {"one prefill": [(0, n)], "chunks": [(0, block), (block, block + 5), (block + 5, 3 * block + 1)]
             + [(p, p + 1) for p in range(3 * block + 1, n)], "decode": [(p, p + 1) for p in range(n)]}
    first_block = 0
    for seat, (name, chunks) in enumerate(paths.items()):
        seq = RingSeq(runner, ids, first_block=first_block, seat=seat)
        first_block += len(seq.blocks)
        got = torch.cat([runner.execute(seq.chunk(a, b), all_logits=True) for a, b in chunks])
        torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    hit = RingSeq(runner, other, first_block=first_block, seat=len(paths))
    hit.blocks[:shared // block] = seq.blocks[:shared // block]  # the decode path's blocks, as the prefix cache
    chunks = [(shared, shared + 13), (shared + 13, n - 4)] + [(p, p + 1) for p in range(n - 4, n)]
    got = torch.cat([runner.execute(hit.chunk(a, b, floor=shared), all_logits=True) for a, b in chunks])
    torch.testing.assert_close(got, want_shared, atol=3e-5, rtol=1e-5)
    # The floor is a documented difference, not noise: the rows just after it read the shared positions from
    # FP8 where a fresh prefill of the same tokens reads them in full precision, and so do all rows the shared
    # attention sinks: past the window the rows read what a fresh prefill without sinks reads.
    fresh = dense_window_logits(runner, other)[shared:]
    assert (want_shared[:window - 1] - fresh[:window - 1]).abs().amax() > 1e-3
    if sinks <= shared:
        no_sinks = dense_window_logits(runner, other, sinks=0)[shared:]
        torch.testing.assert_close(want_shared[window:], no_sinks[window:], atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_prefill_without_window_equals_sdpa_over_the_cache(one_layer, kv_cache_dtype, dtype):
    """No window: prefill rows through the decode op give the logits of SDPA over the K/V as the cache holds
    them (dense_window_logits), for a fresh prompt, a later chunk and a single token (bfloat16: the decode op
    rounds the probabilities to bfloat16, so within bfloat16 rounding)."""
    loaded_dtype = one_layer if dtype == "float32" else load_model(
        EngineConfig(model=one_layer.model_path, dtype=dtype), progress=False)
    ids = prompt_ids(50, seed=5)
    runner = make_runner(loaded_dtype, kv_cache_dtype, 0, dtype=dtype)
    want = dense_window_logits(runner, ids).float()
    seq = RingSeq(runner, ids)
    got = torch.cat([runner.execute(seq.chunk(a, b), all_logits=True).float()
                     for a, b in ((0, 30), (30, 31), (31, 50))])
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == "float32" else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("sinks", [0, 1, 3])
def test_evals_one_prefill_writes_and_reads_the_sinks(loaded, sinks):
    """fp8kv eval's window as one prefill (quality.eval.runner_batch) writes the sinks' seats as well as the
    newest positions', and its logits are the dense oracle's."""
    ids = prompt_ids(40, seed=6)
    runner = make_runner(loaded, "fp8_e4m3", 8, kv_recent_window_sinks=sinks)
    torch.testing.assert_close(runner.execute(runner_batch(ids, runner), all_logits=True),
                               dense_window_logits(runner, ids), atol=2e-4, rtol=1e-4)


def test_window_changes_logits_only_through_full_precision(loaded):
    """A window as long as the text equals the auto cache; no window equals plain FP8; one between differs
    from both and lies closer to auto."""
    ids = prompt_ids(48, seed=1)
    logits = {}
    for name, dtype, window in (("auto", "auto", None), ("plain", "fp8_e5m2", 0), ("whole", "fp8_e5m2", 48),
                                ("part", "fp8_e5m2", 16)):
        runner = make_runner(loaded, dtype, window)
        logits[name] = runner.execute(runner_batch(ids, runner), all_logits=True)
    torch.testing.assert_close(logits["whole"], logits["auto"], atol=1e-5, rtol=1e-5)
    err_plain = (logits["plain"] - logits["auto"]).abs().mean()
    err_part = (logits["part"] - logits["auto"]).abs().mean()
    assert 0 < err_part < err_plain


def test_bfloat16_window_halves_its_memory_and_rounds_only_the_newest_tokens(loaded):
    """A float32 model with a bfloat16 window: half the window bytes, and a window covering the whole text
    reads every K/V rounded to bfloat16, i.e. close to the float32 auto cache, far closer than plain FP8."""
    ids = prompt_ids(48, seed=2)
    runners = {name: make_runner(loaded, dtype, window,
                                 kv_recent_window_dtype=window_dtype)
               for name, dtype, window, window_dtype in (
                   ("auto", "auto", None, "auto"), ("plain", "fp8_e4m3", 0, "auto"),
                   ("f32", "fp8_e4m3", 48, "auto"), ("bf16", "fp8_e4m3", 48, "bfloat16"))}
    f32, bf16 = runners["f32"], runners["bf16"]
    assert f32.window_caches[0][0].dtype == torch.float32 and bf16.window_caches[0][0].dtype == torch.bfloat16
    assert bf16.cache_plan.window_seats == f32.cache_plan.window_seats
    assert 2 * bf16.cache_plan.window_bytes == f32.cache_plan.window_bytes
    assert bf16.num_blocks > f32.num_blocks  # the bytes saved go to the FP8 cache
    assert ModelInfo.from_runner(bf16).window_dtype == "bfloat16"  # what /info and the startup line show
    assert ModelInfo.from_runner(bf16).kv_recent_window_sinks == 1
    lines = []
    make_runner(loaded, "fp8_e4m3", 8, kv_recent_window_dtype="bfloat16", log_to=lines.append)
    assert any("newest 8 tokens of each sequence, and its first 1 (attention sink), also in bfloat16" in line
               for line in lines)
    logits = {name: r.execute(runner_batch(ids, r), all_logits=True) for name, r in runners.items()}
    torch.testing.assert_close(logits["f32"], logits["auto"], atol=1e-5, rtol=1e-5)
    err_bf16 = (logits["bf16"] - logits["auto"]).abs().mean()
    err_plain = (logits["plain"] - logits["auto"]).abs().mean()
    assert 0 < err_bf16 < err_plain / 4


def test_bad_window_dtype_is_refused(loaded):
    with pytest.raises(ValueError, match="kv_recent_window_dtype='int8'.*bfloat16"):
        make_runner(loaded, "fp8_e4m3", 8, kv_recent_window_dtype="int8")


def test_auto_cache_ignores_the_window(loaded):
    runner = make_runner(loaded, "auto", 32)
    assert runner.kv_recent_window == 0 and runner.window_caches is None


def test_bad_window_is_refused(loaded):
    with pytest.raises(ValueError, match="kv_recent_window=-1"):
        make_runner(loaded, "fp8_e4m3", -1)


def test_batch_without_window_slots_is_refused(loaded):
    runner = make_runner(loaded, "fp8_e4m3", 8)
    with pytest.raises(ValueError, match="window_slot_mapping"):
        runner.execute(window_batch(prompt_ids(10), BLOCK))


# ---- the engine ----------------------------------------------------------------------------------------

def run_engine(loaded, prompts: list[list[int]], max_tokens: int, **overrides) -> tuple[LLMEngine, list]:
    config = EngineConfig(model=loaded.model_path, block_size=BLOCK,
                          kv_cache_memory=overrides.pop("kv_cache_memory", "16MiB"), **overrides)
    engine = LLMEngine(config, log=lambda _: None, runner=ModelRunner(config, log=lambda _: None, loaded=loaded))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        engine.block_manager.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    if bm.window:
        assert bm.window.num_free_seats == bm.window.num_seats, "recent-window seats leaked"
    return engine, [done[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    base = prompt_ids(40, seed=2)
    return [base + prompt_ids(5 + 3 * i, seed=10 + i) for i in range(3)] + [prompt_ids(20, seed=3)]


def test_window_longer_than_every_sequence_equals_auto_and_transformers(loaded, shared_prompts):
    from transformers import AutoModelForCausalLM

    _, auto = run_engine(loaded, shared_prompts, 12, kv_cache_dtype="auto")
    engine, windowed = run_engine(loaded, shared_prompts, 12, kv_cache_dtype="fp8_e5m2", kv_recent_window=128)
    assert windowed == auto
    assert engine.stats.prefix_cache_hits == 0  # every cached block lies inside some prompt's window
    model = AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval()
    for prompt, out in zip(shared_prompts, auto):
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
        assert out == gen[0, len(prompt):].tolist()


def test_preemption_recomputes_the_window_and_gives_the_same_tokens(loaded, shared_prompts, monkeypatch):
    """A cache too small for all sequences preempts and recomputes (refilling the ring); the tokens equal
    those of a cache big enough for all, and nothing leaks."""
    # Seats for all 4 sequences beside only 16 blocks: more seats than the default share of so small a budget.
    monkeypatch.setattr(sizing, "WINDOW_BUDGET_SHARE", 1)
    kw = {"kv_cache_dtype": "fp8_e4m3", "kv_recent_window": 8, "enable_prefix_caching": False, "max_num_seqs": 4}
    _, roomy = run_engine(loaded, shared_prompts, 10, **kw)
    block = 2 * 2 * 2 * 64 * BLOCK  # layers * K/V * kv heads * head size * tokens, 1 byte each
    seat = 2 * 2 * 2 * 64 * 4 * 2 * BLOCK  # 8 tokens and 1 attention sink round up to 2 blocks, in float32
    engine, tight = run_engine(loaded, shared_prompts, 10, kv_cache_memory=16 * block + 4 * seat,
                               max_num_batched_tokens=24, **kw)
    assert engine.block_manager.window.num_seats == 4 and engine.block_manager.num_blocks == 16
    assert engine.stats.num_preemptions > 0
    assert tight == roomy


def test_prefix_caching_on_and_off_agree_and_abort_frees_the_seat(loaded, shared_prompts):
    _, off = run_engine(loaded, shared_prompts, 8, kv_cache_dtype="fp8_e4m3", kv_recent_window=8,
                        enable_prefix_caching=False)
    engine, on = run_engine(loaded, shared_prompts[:1], 8, kv_cache_dtype="fp8_e4m3", kv_recent_window=8)
    engine.add_request("late", shared_prompts[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("gone", shared_prompts[2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {}
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    assert engine.stats.prefix_cache_hits > 0
    assert on[0] == off[0] and outs["late"] == off[1]
    bm = engine.block_manager
    assert bm.window.num_free_seats == bm.window.num_seats and bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_reads_its_sinks_as_the_fp8_cache_holds_them(loaded, shared_prompts):
    """A sequence whose first blocks come from the prefix cache never computed its attention sinks: the engine
    fills their ring seats from the FP8 cache, so a ring full of garbage (another sequence's, here noise) is never
    read, and the tokens equal those without prefix caching (which read the sink in full precision: within FP8's
    error, far inside what noise in a sink seat would do)."""
    kw = {"kv_cache_dtype": "fp8_e4m3", "kv_recent_window": 8, "kv_recent_window_sinks": 1}
    _, off = run_engine(loaded, shared_prompts[:2], 8, enable_prefix_caching=False, **kw)
    config = EngineConfig(model=loaded.model_path, block_size=BLOCK, kv_cache_memory="16MiB", **kw)
    engine = LLMEngine(config, log=lambda _: None, runner=ModelRunner(config, log=lambda _: None, loaded=loaded))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    on = []
    for i, prompt in enumerate(shared_prompts[:2]):  # one after the other: the second hits the first's blocks
        for cache in engine.runner.window_caches:
            for t in cache:
                t.copy_(torch.randn(t.shape, generator=g) * 30)
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            on += [out.outputs[0].token_ids for out in engine.step() if out.finished]
    assert engine.stats.prefix_cache_hits > 0
    assert on == off


def test_window_recorded_in_the_scales_file_is_used_unless_one_is_given(loaded, tmp_path):
    import json

    from fp8cache.kvcache import scale_files
    from fp8cache.kvcache import scales as kv_scales

    scales = kv_scales.ones(2, "fp8_e4m3")
    path = tmp_path / "scales.json"
    scale_files.write_scales_file(path, kv_scales.KVScales(scales.k, scales.v, "fp8_e4m3", "test", recent_window=12),
                                "llama", 2)
    assert json.loads(path.read_text())["kv_recent_window"] == 12
    assert make_runner(loaded, "fp8_e4m3", None, quantization_param_path=str(path)).kv_recent_window == 12
    assert make_runner(loaded, "fp8_e4m3", 4, quantization_param_path=str(path)).kv_recent_window == 4
    doc = json.loads(path.read_text())
    doc["kv_recent_window"] = -3
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="kv_recent_window"):
        make_runner(loaded, "fp8_e4m3", None, quantization_param_path=str(path))


def test_prefill_chunks_of_one_shape_apart_in_the_stream(loaded):
    """Two prefill chunks of one shape with another sequence between them (one prefill group whose rows are
    not one slice of the stream), first chunks and later ones (earlier window positions), give the logits
    each sequence gets on its own."""
    def run(together: bool) -> list[torch.Tensor]:
        runner = make_runner(loaded, "fp8_e4m3", 8)
        seqs, first_block = [], 0
        for seat, n in enumerate((40, 14, 40)):
            seqs.append(RingSeq(runner, prompt_ids(n, seed=10 + seat), first_block=first_block, seat=seat))
            first_block += len(seqs[-1].blocks)
        steps = [[(0, 20), (0, 13), (0, 20)], [(20, 40), (13, 14), (20, 40)]]
        if together:
            return [runner.execute(merged([s.chunk(*c) for s, c in zip(seqs, chunks)])) for chunks in steps]
        return [torch.cat([runner.execute(s.chunk(*c)) for s, c in zip(seqs, chunks)]) for chunks in steps]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
