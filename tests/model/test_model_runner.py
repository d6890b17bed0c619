"""ModelRunner against Hugging Face transformers' own forward, and FP8 cache bytes against the reference ops."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_logits_close
from safetensors.torch import load_file, save_file

from fp8cache import ops
from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, sizing
from fp8cache.kvcache.scales import KVScales
from fp8cache.kvcache.sizing import parse_memory_size, plan_cache
from fp8cache.kvcache.spec import KVCacheSpec
from fp8cache.model import attention, forward_context
from fp8cache.model.batch import SeqChunk, StepBatch
from fp8cache.model.loader import ModelLoadError, load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference

TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
        "structure in Paris. Its base is square, measuring 125 metres on each side. During its construction "
        "it surpassed the Washington Monument to become the tallest man-made structure in the world.")
TINY_TEXT = ("the city of the river was the first new school in the world and the people of the state had "
             "a house by the water when the war was over and the team would play a game")
BLOCK = 16


# ---- helpers -----------------------------------------------------------------------------------------

class Seq:
    """One sequence's tokens and blocks, handing out the StepBatch pieces for a range of positions."""

    def __init__(self, ids: list[int], blocks: list[int]):
        self.ids, self.blocks = list(ids), list(blocks)

    def slot(self, pos: int) -> int:
        return self.blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def step(parts: list[tuple[Seq, int, int]], want_logits: bool = True) -> StepBatch:
    """A packed step feeding positions [start, end) of each (seq, start, end)."""
    batch = StepBatch()
    for seq, start, end in parts:
        batch.token_ids += seq.ids[start:end]
        batch.positions += list(range(start, end))
        batch.slot_mapping += [seq.slot(p) for p in range(start, end)]
        batch.seqs.append(SeqChunk(end - start, end, seq.blocks[:-(-end // BLOCK)], want_logits))
    return batch


def make_runner(loaded, kv_cache_dtype: str = "auto", **overrides) -> ModelRunner:
    """A runner whose FP8 cache holds every token (no recent-token window: tests/model/test_recent_window.py)."""
    overrides.setdefault("kv_recent_window", 0)
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                          kv_cache_memory=overrides.pop("kv_cache_memory", "64MiB"), **overrides)
    return ModelRunner(config, log=lambda msg: None, loaded=loaded)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def raw_cache(runner: ModelRunner, layer: int, seq: Seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored K and V elements of positions [0, n): [n, kv_heads, head_size], undecoded (docs/design.md section 4)."""
    key_cache, value_cache = runner.kv_caches[layer]
    blocks = torch.tensor([seq.slot(p) // BLOCK for p in range(n)])
    offsets = torch.tensor([p % BLOCK for p in range(n)])
    k = key_cache[blocks, :, :, offsets, :].reshape(n, runner.num_kv_heads, runner.head_size)
    v = value_cache[blocks, :, :, offsets]
    return k, v


# ---- fixtures ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(default_loaded):
    return default_loaded  # the session's, shared with the other modules' runners


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_path):
    return load_model(EngineConfig(model=tiny_llama_path), progress=False)


@pytest.fixture(scope="module")
def text_ids(loaded):
    return loaded.tokenizer(TEXT)["input_ids"]


# ---- the auto cache equals transformers ----------------------------------------------------------------

def test_prefill_then_decode_matches_transformers(loaded, hf_model, text_ids):
    runner = make_runner(loaded)
    seq = Seq(text_ids[:9], [3, 7])
    logits = runner.execute(step([(seq, 0, 9)]), all_logits=True)
    assert logits.dtype == torch.float32 and logits.shape == (9, runner.hf_config.vocab_size)
    assert_logits_close(logits, hf_logits(hf_model, seq.ids))
    for _ in range(4):
        seq.ids.append(int(logits[-1].argmax()))
        n = len(seq.ids)
        logits = runner.execute(step([(seq, n - 1, n)]))
        assert logits.shape == (1, runner.hf_config.vocab_size)
        assert_logits_close(logits[0], hf_logits(hf_model, seq.ids)[-1])


def test_packed_sequences_of_different_lengths_match_transformers(loaded, hf_model, text_ids):
    runner = make_runner(loaded)
    seqs = [Seq(text_ids[:5], [0, 1]), Seq(text_ids[5:24], [2, 3, 9]), Seq(text_ids[10:40], [4, 5, 6])]
    # Step 1: two prefills packed. Step 2: two decodes and a prefill in one stream. Step 3: three decodes.
    logits = runner.execute(step([(seqs[0], 0, 5), (seqs[1], 0, 19)]))
    assert logits.shape[0] == 2
    for row, seq in zip(logits, seqs[:2]):
        assert_logits_close(row, hf_logits(hf_model, seq.ids)[-1])
    for row, seq in zip(logits, seqs[:2]):
        seq.ids.append(int(row.argmax()))
    logits = runner.execute(step([(seqs[0], 5, 6), (seqs[2], 0, 30), (seqs[1], 19, 20)]))
    for row, seq in zip(logits, [seqs[0], seqs[2], seqs[1]]):
        assert_logits_close(row, hf_logits(hf_model, seq.ids)[-1])
        seq.ids.append(int(row.argmax()))
    logits = runner.execute(step([(s, len(s.ids) - 1, len(s.ids)) for s in seqs]))
    for row, seq in zip(logits, seqs):
        assert_logits_close(row, hf_logits(hf_model, seq.ids)[-1])


def test_want_logits_false_rows_are_left_out(loaded, text_ids):
    runner = make_runner(loaded)
    a, b = Seq(text_ids[:12], [0]), Seq(text_ids[:7], [1])
    batch = step([(a, 0, 6), (b, 0, 7)])
    batch.seqs[0].want_logits = False  # a prefill chunk that does not reach its prompt's end
    logits = runner.execute(batch)
    assert logits.shape[0] == 1
    assert_logits_close(logits[0], make_runner(loaded).execute(step([(b, 0, 7)]))[0])


def assert_same_step(actual: torch.Tensor, expected: torch.Tensor, kv_cache_dtype: str) -> None:
    """Same computation, possibly split differently into steps.

    With an FP8 cache, float rounding that differs with the number of rows in a matmul (13 vs 40 tokens)
    can move a value across an FP8 rounding boundary, and the difference grows through the layers:
    measured on the default model, mean |diff| 0.026 (e4m3) and 0.086 (e5m2), while dropping the cached
    prefix gives 4.8. Exact chunk/prefix semantics in FP8 are checked on the attention alone.
    """
    if kv_cache_dtype == "auto":
        assert_logits_close(actual, expected)
        return
    mean_diff = (actual - expected).abs().mean().item()
    assert mean_diff < 0.25, f"mean abs difference {mean_diff:.3g}"
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_chunked_prefill_equals_one_shot(loaded, text_ids, kv_cache_dtype):
    runner = make_runner(loaded, kv_cache_dtype)
    ids = text_ids[:40]
    whole = runner.execute(step([(Seq(ids, [0, 1, 2]), 0, 40)]), all_logits=True)
    chunked = Seq(ids, [10, 4, 7])
    parts = [runner.execute(step([(chunked, a, b)], want_logits=True), all_logits=True)
             for a, b in ((0, 13), (13, 29), (29, 40))]
    assert_same_step(torch.cat(parts), whole, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_prefix_read_from_shared_blocks(loaded, text_ids, kv_cache_dtype):
    runner = make_runner(loaded, kv_cache_dtype)
    prefix = text_ids[:2 * BLOCK]
    first = Seq(prefix + text_ids[40:45], [0, 1, 2])
    runner.execute(step([(first, 0, len(first.ids))]))
    # The second sequence reuses the first one's two full blocks; only its own tokens are computed.
    second = Seq(prefix + text_ids[50:61], [0, 1, 5])
    cached = runner.execute(step([(second, 2 * BLOCK, len(second.ids))]), all_logits=True)
    fresh = Seq(second.ids, [8, 9, 10])
    full = runner.execute(step([(fresh, 0, len(fresh.ids))]), all_logits=True)
    assert_same_step(cached, full[2 * BLOCK:], kv_cache_dtype)


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"])
def test_attention_reads_prefix_and_chunks_from_the_cache(kv_cache_dtype, use_compiled):
    """Every query row of a step equals reference decode attention over the cache up to its position."""
    torch.manual_seed(0)
    heads, kv_heads, d, scale = 4, 2, 64, 64 ** -0.5
    caches = [reference.allocate_kv_cache(12, BLOCK, kv_heads, d, kv_cache_dtype, torch.float32)]
    k_scale, v_scale = torch.tensor([0.004, 0.008]), torch.tensor([0.003])
    # seq 0: 25 cached tokens + a 15-token chunk; seq 1: decode after 19 cached; seq 2: fresh 10-token prefill
    seqs = [(Seq([0] * 40, [3, 0, 5]), 25, 40), (Seq([0] * 20, [7, 2]), 19, 20), (Seq([0] * 10, [9]), 0, 10)]
    for seq, cached, _ in seqs:
        k, v = torch.randn(cached, kv_heads, d), torch.randn(cached, kv_heads, d)
        slots = torch.tensor([seq.slot(p) for p in range(cached)], dtype=torch.long)
        reference.reshape_and_cache(k, v, *caches[0], slots, kv_cache_dtype, k_scale, v_scale)
    batch = step(seqs)
    n = len(batch.token_ids)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    step_ops = ops if use_compiled else reference
    spec = KVCacheSpec.build(kv_cache_dtype, torch.float32, BLOCK, 1, kv_heads, d,
                             KVScales([k_scale], [v_scale], kv_cache_dtype, "test"))
    ctx = forward_context.build_forward_context(batch, step_ops, caches, spec)
    layer = SimpleNamespace(layer_idx=0)
    out, weights = attention.paged_attention_forward(
        layer, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
        scaling=scale, **{forward_context.CONTEXT_KWARG: ctx})
    assert out.shape == (1, n, heads, d) and weights is None
    row = 0
    for seq, start, end in seqs:
        table = torch.tensor([seq.blocks], dtype=torch.int32)
        for pos in range(start, end):
            want = torch.empty(1, heads, d)
            reference.paged_attention(want, q[row][None], *caches[0], kv_heads, scale, table,
                                      torch.tensor([pos + 1], dtype=torch.int32), BLOCK, pos + 1, None,
                                      kv_cache_dtype, k_scale, v_scale)
            assert_logits_close(out[0, row], want[0], atol=1e-5)
            row += 1


# ---- FP8 caches ------------------------------------------------------------------------------------------

# Top-1 agreement with the auto cache over TEXT's 66 positions (scales 1.0), measured 0.955 (e4m3),
# 0.939 (e5m2), 0.955 (e4m3fnuz); the floors leave room for rounding differences between machines.
@pytest.mark.parametrize("kv_cache_dtype,floor", [("fp8_e4m3", 0.9), ("fp8_e5m2", 0.85),
                                                   ("fp8_e4m3fnuz", 0.9)])
def test_fp8_cache_stays_close_to_auto(loaded, text_ids, kv_cache_dtype, floor):
    seq = Seq(text_ids, list(range(8)))
    auto = make_runner(loaded).execute(step([(seq, 0, len(seq.ids))]), all_logits=True)
    fp8_runner = make_runner(loaded, kv_cache_dtype)
    fp8 = fp8_runner.execute(step([(seq, 0, len(seq.ids))]), all_logits=True)
    agreement = (auto.argmax(-1) == fp8.argmax(-1)).float().mean().item()
    assert agreement >= floor
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), auto.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert 0 < kl < 0.1
    assert fp8_runner.bytes_per_token * 4 == make_runner(loaded).bytes_per_token  # uint8 vs float32


def test_runner_attributes(loaded):
    runner = make_runner(loaded, "fp8", max_model_len=512)
    assert runner.cache_dtype_name == "fp8_e4m3"  # "fp8" on CPU
    assert (runner.num_layers, runner.num_kv_heads, runner.head_size) == (30, 3, 64)
    assert runner.bytes_per_token == 2 * 30 * 3 * 64
    assert runner.capacity_tokens == runner.num_blocks * BLOCK
    assert runner.max_model_len == 512 and runner.dtype == torch.float32
    assert loaded.tokenizer.eos_token_id in runner.eos_token_ids
    assert runner.scales_source == "default 1.0"
    assert runner.cache_fingerprint != make_runner(loaded).cache_fingerprint
    key_cache, value_cache = runner.kv_caches[0]
    assert key_cache.dtype == torch.uint8 and key_cache.shape == (runner.num_blocks, 3, 4, BLOCK, 16)
    assert value_cache.shape == (runner.num_blocks, 3, 64, BLOCK)


# ---- a tiny random Llama in a local folder -------------------------------------------------------------

def tiny_ids(loaded) -> list[int]:
    return loaded.tokenizer(TINY_TEXT)["input_ids"]


def test_tiny_llama_folder_matches_transformers(tiny_loaded, tiny_llama_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation="eager").eval()
    runner = make_runner(tiny_loaded)
    seq = Seq(tiny_ids(tiny_loaded)[:20], [1, 2])
    logits = runner.execute(step([(seq, 0, 20)]), all_logits=True)
    assert_logits_close(logits, hf_logits(hf, seq.ids))
    seq.ids.append(int(logits[-1].argmax()))
    assert_logits_close(runner.execute(step([(seq, 20, 21)]))[0], hf_logits(hf, seq.ids)[-1])


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_other_architectures_match_transformers(make_tiny_model, model_type):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(model_type)
    loaded = load_model(EngineConfig(model=path), progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    runner = make_runner(loaded, max_model_len=64)
    seq = Seq([(7 * i) % 50 + 3 for i in range(20)], [3, 1])
    assert_logits_close(runner.execute(step([(seq, 0, 20)]), all_logits=True), hf_logits(hf, seq.ids))
    seq.ids.append(5)
    assert_logits_close(runner.execute(step([(seq, 20, 21)]))[0], hf_logits(hf, seq.ids)[-1])


def test_bfloat16_model_runs_close_to_float32(tiny_llama_path, tiny_loaded):
    bf16 = load_model(EngineConfig(model=tiny_llama_path, dtype="bfloat16"), progress=False)
    runner = make_runner(bf16, "fp8_e4m3", dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    seq = Seq(tiny_ids(tiny_loaded)[:20], [0, 1])
    got = runner.execute(step([(seq, 0, 20)]), all_logits=True)
    want = make_runner(tiny_loaded).execute(step([(seq, 0, 20)]), all_logits=True)
    assert got.dtype == torch.float32
    assert_logits_close(got, want, atol=0.1 * want.abs().max().item())


def layer0_auto_kv(tiny_loaded, seq: Seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float32 K/V of layer 0 as the auto cache stores them (layer 0 sees no quantized input)."""
    runner = make_runner(tiny_loaded)
    runner.execute(step([(seq, 0, n)]))
    return raw_cache(runner, 0, seq, n)


def check_layer0_codes(runner: ModelRunner, tiny_loaded, n: int = 24) -> None:
    """Run a prefill and check layer 0's stored codes are reference.quantize(x, the runner's scale)."""
    seq = Seq(tiny_ids(tiny_loaded)[:n], [0, 1])
    k, v = layer0_auto_kv(tiny_loaded, seq, n)
    runner.execute(step([(seq, 0, n)]))
    fmt = formats.FP8_FORMATS[runner.cache_dtype_name]
    k_codes, v_codes = raw_cache(runner, 0, seq, n)
    assert torch.equal(k_codes, reference.quantize(k, runner.scales.k[0], fmt))
    assert torch.equal(v_codes, reference.quantize(v, runner.scales.v[0], fmt))


def test_scales_from_json_file_shape_the_cache_bytes(tiny_loaded, per_head_scales):
    k_heads, path = per_head_scales
    runner = make_runner(tiny_loaded, "fp8_e4m3", quantization_param_path=str(path))
    assert runner.scales_source == f"file {path}"
    assert torch.equal(runner.scales.k[1], torch.tensor(k_heads[1], dtype=torch.float32))
    check_layer0_codes(runner, tiny_loaded)
    # E4M3FN scales on an E4M3FNUZ cache are doubled (docs/design.md section 3).
    fnuz = make_runner(tiny_loaded, "fp8_e4m3fnuz", quantization_param_path=str(path))
    assert torch.equal(fnuz.scales.v[0], torch.tensor([0.008]))
    check_layer0_codes(fnuz, tiny_loaded)
    assert fnuz.cache_fingerprint != runner.cache_fingerprint


def test_scales_from_checkpoint_tensors(tiny_llama_path, tmp_path):
    folder = str(tmp_path / "with-scales")
    shutil.copytree(tiny_llama_path, folder)
    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    for i, (k, v) in enumerate([(0.02, 0.007), (0.04, 0.009)]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, weights, metadata={"format": "pt"})
    loaded = load_model(EngineConfig(model=folder), progress=False)
    assert sorted(loaded.checkpoint_scale_tensors) == sorted(n for n in tensors if n.endswith("_scale"))
    runner = make_runner(loaded, "fp8_e4m3")
    assert runner.scales_source == "checkpoint"
    assert torch.equal(runner.scales.k[1], torch.tensor([0.04]))
    check_layer0_codes(runner, loaded)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_calculate_kv_scales_from_first_batch(tiny_loaded, granularity):
    runner = make_runner(tiny_loaded, "fp8_e4m3", calculate_kv_scales=True, kv_scales_granularity=granularity)
    assert runner.scales is None
    pending = runner.cache_fingerprint
    n = 24
    seq = Seq(tiny_ids(tiny_loaded)[:n], [0, 1])
    k, v = layer0_auto_kv(tiny_loaded, seq, n)
    check_layer0_codes(runner, tiny_loaded, n)
    for stored, x in ((runner.scales.k[0], k), (runner.scales.v[0], v)):
        amax = x.abs().amax(dim=(0, 2))  # per KV head
        if granularity == "tensor":
            amax = amax.max().reshape(1)
        torch.testing.assert_close(stored, amax / 448.0)
    assert runner.scales.k[0].numel() == (1 if granularity == "tensor" else runner.num_kv_heads)
    fixed = runner.cache_fingerprint
    assert fixed != pending
    other = Seq(list(reversed(seq.ids)), [2, 3])
    runner.execute(step([(other, 0, n)]))
    assert runner.cache_fingerprint == fixed  # later steps reuse the first batch's scales


# ---- bad input ---------------------------------------------------------------------------------------

def test_bad_model_paths_are_refused_clearly(tmp_path, tiny_llama_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(EngineConfig(model=str(tmp_path / "nowhere")))
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_model(EngineConfig(model=str(a_file)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(EngineConfig(model=str(empty)))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(tiny_llama_path, "config.json"), no_weights)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(EngineConfig(model=str(no_weights)))
    torch.save(load_file(os.path.join(tiny_llama_path, "model.safetensors")), no_weights / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle.*use_safetensors=True"):
        load_model(EngineConfig(model=str(no_weights)))


def test_bad_runner_settings_are_refused(tiny_loaded):
    with pytest.raises(ValueError, match="valid choices"):
        make_runner(tiny_loaded, "fp8_e3m4")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_runner(tiny_loaded, max_model_len=10**6)
    with pytest.raises(ValueError, match="kv_scales_granularity"):
        make_runner(tiny_loaded, "fp8", calculate_kv_scales=True, kv_scales_granularity="channel")
    runner = make_runner(tiny_loaded)
    seq = Seq(tiny_ids(tiny_loaded)[:20], [0])
    with pytest.raises(ValueError, match="block_table"):
        runner.execute(StepBatch(seq.ids, list(range(20)), list(range(20)), [SeqChunk(20, 20, [0])]))


def test_kv_cache_memory_sizes():
    assert parse_memory_size("2GiB") == 2 * 2**30
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size(4096) == 4096
    for bad in ("2 gigs", "GiB", "-1GiB", "0"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_memory_size(bad)
    plan = plan_cache("1MiB", 0.3, 16, 1000)
    assert plan.num_blocks == 2**20 // (16 * 1000)
    with pytest.raises(ValueError, match="no block"):
        plan_cache(1000, 0.3, 16, 1000)
    assert plan_cache(None, 0.01, 16, 1000).num_blocks >= 1  # a fraction of MemAvailable


def test_default_cache_is_sized_by_need_within_the_host_share():
    """No kv_cache_memory: what max_num_seqs sequences of max_model_len need (with their window seats), not a
    share of whatever memory is free (8 GB for a 20-token generate); the share only caps it."""
    plan = plan_cache(None, 0.3, 16, 1000, max_num_seqs=4, max_model_len=250)
    assert plan.capacity_tokens == 4 * 256  # whole blocks
    assert plan.budget_source.startswith("sized for max_num_seqs 4")
    windowed = plan_cache(None, 0.3, 16, 1000, window_size=32, window_token_bytes=2000, max_num_seqs=4,
                          max_model_len=250)
    assert windowed.capacity_tokens == 4 * 256 and windowed.window_seats == 4
    capped = plan_cache(None, 1e-9, 16, 1000, max_num_seqs=4, max_model_len=250, device_limit=sizing.DeviceLimit(
        64_000, "a test cap"))
    assert capped.budget_bytes == 64_000 and capped.budget_source == "a test cap"


def test_gpu_budget_leaves_room_for_weights_activations_and_the_utilization(monkeypatch):
    """vLLM's gpu_memory_utilization: of 0.9 of the GPU, what is in use now and the activations are not the
    cache's."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 2**30, 80 * 2**30))
    limit = sizing.gpu_limit(torch.device("cuda", 0), 0.9, 2 * 2**30)
    assert limit.bytes == int(0.9 * 80 * 2**30) - 20 * 2**30 - 2 * 2**30
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        sizing.gpu_limit(torch.device("cuda", 0), 1.5, 0)


def test_cache_is_sized_from_kv_cache_memory(tiny_loaded):
    runner = make_runner(tiny_loaded, "fp8_e5m2", kv_cache_memory="1MiB")
    assert runner.bytes_per_token == 2 * 2 * 2 * 64
    assert runner.num_blocks == 2**20 // (BLOCK * runner.bytes_per_token)
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks
