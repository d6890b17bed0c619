"""The GPU code paths, run on every machine: the engine on a stand-in device under FakeTensorMode (fake_gpu.py),
where a CPU tensor meeting a device tensor raises as on CUDA, and where the host syncs, host-to-device copies
and device ops of a decode step are counted, so that a decode step stays CUDA-graph-ready.

What only a GPU shows (values, speed) is for tests/ops/test_ops_cuda.py, tests/engine/test_gpu_engine.py and
scripts/gpu_check.sh on a machine with one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from fake_gpu import fake_gpu

from fp8cache.config import EngineConfig
from fp8cache.engine.llm_engine import LLMEngine
from fp8cache.engine.sampling_params import SamplingParams, StructuredOutputsParams
from fp8cache.model import step_metadata
from fp8cache.model.loader import LoadedModel, load_model
from fp8cache.model.runner import ModelRunner

# SmolLM2-135M-Instruct, the default model (9 query / 3 KV heads of 64, 30 layers).
DEFAULT_MODEL_SHAPES = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                        "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("gpu-paths")), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def default_shapes_path(tmp_path_factory) -> str:
    """A folder with the default model's config.json and a tokenizer, no weights (the model is made from the
    config on the stand-in device)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("default-shapes")
    LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2, **DEFAULT_MODEL_SHAPES).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def _engine(path: str, loaded: LoadedModel | None = None, **overrides) -> LLMEngine:
    settings = {"model": path, "device": "meta", "dtype": "bfloat16", "kv_cache_dtype": "fp8",
                "kv_cache_memory": "8MiB", "max_model_len": 512} | overrides
    config = EngineConfig(**settings)
    loaded = loaded or load_model(config)
    return LLMEngine(config, log=lambda msg: None, runner=ModelRunner(config, log=lambda msg: None, loaded=loaded))


def _run(engine: LLMEngine, steps: int = 200) -> int:
    for n in range(steps):
        engine.step()
        if not engine.has_unfinished_requests():
            return n + 1
    raise AssertionError(f"requests still unfinished after {steps} steps")


# (kv_cache_dtype, recent window, cache memory): the window's seats need room, without a window the cache is
# small enough (12 blocks) that the long requests preempt each other.
STEP_CASES = [("fp8", 32, "2MiB"), ("fp8", 0, 12 * 16 * 512), ("fp8_e4m3fnuz", 8, "1MiB"), ("auto", 0, 12 * 16 * 1024)]


@pytest.mark.parametrize("kv_cache_dtype,window,memory", STEP_CASES)
def test_every_engine_step_keeps_to_the_gpu(tiny_path, kv_cache_dtype, window, memory):
    """Chunked prefill, decode, the recent-token window, a prefix-cache hit and preemption, and the sampling
    features, with every tensor on the device (a CPU one meeting it raises)."""
    shared = [5, 6, 7, 8] * 12  # a long shared prefix: the second request hits the prefix cache
    with fake_gpu():
        engine = _engine(tiny_path, kv_cache_dtype=kv_cache_dtype, kv_recent_window=window,
                         max_num_batched_tokens=32, kv_cache_memory=memory, max_num_seqs=4)
        engine.add_request("chunked", shared + [9, 10], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
        _run(engine)
        engine.add_request("prefix-hit", shared + [11], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2,
                                                                    temperature=0))
        engine.add_request("sampled", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8,
                                                              top_p=0.9, top_k=5, repetition_penalty=1.2,
                                                              logit_bias={7: 2.0}))
        engine.add_request("guided", [4, 9], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["city", "river"])))
        for n in range(4):  # more than the small cache holds at once: someone is preempted
            engine.add_request(f"long-{n}", [12 + n] * 40, SamplingParams(max_tokens=30, ignore_eos=True))
        _run(engine, 400)
        stats = engine.stats
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0 or window > 0
    assert stats.blocks_used == 0


@pytest.mark.parametrize("window", [0, 32])
def test_a_decode_step_waits_once_and_copies_once(default_shapes_path, window):
    """The default model's shapes, 64 sequences, an FP8 cache: one host sync a step (the sampled tokens), one
    packed non-blocking copy of the step's metadata, and <= 20 device ops a decoder layer (fused norms, one q/k/v
    and one gate/up matmul, the cache write and the attention as single ops), so that the step can be captured
    as a CUDA graph and the GPU is not starved by launches."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(default_shapes_path)
    with torch.device("meta"):  # no weights: 135M parameters of shape only
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    with fake_gpu() as work:
        loaded = LoadedModel(model, AutoTokenizer.from_pretrained(default_shapes_path), model.config,
                             default_shapes_path)
        engine = _engine(default_shapes_path, loaded, kv_recent_window=window, kv_cache_memory="64MiB",
                         max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=256)
        for n in range(64):
            engine.add_request(str(n), [3 + n % 7] * 16, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        while engine.stats.num_generated_tokens < 64:  # the prefill steps
            engine.step()
        work.reset()
        engine.step()  # a decode step of 64 sequences
    layers = DEFAULT_MODEL_SHAPES["num_hidden_layers"]
    print(f"decode step: {work.syncs} syncs, {len(work.h2d)} host-to-device copies, {work.device_ops()} device ops "
          f"({work.device_ops() / layers:.1f} a layer): {dict(work.ops.most_common(12))}")
    assert work.syncs <= 1
    assert len(work.h2d) <= 2 and all(work.h2d)
    assert work.device_ops() <= 20 * layers + 30  # the layers, plus embedding, rotary tables, final norm, logits
    assert work.ops["paged_attention_window" if window else "paged_attention"] == layers


def test_eval_runs_on_the_gpu(tiny_path, tmp_path):
    from fp8cache.quality.eval import evaluate

    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the city of water and music"] * 200))
    with fake_gpu():
        result = evaluate(EngineConfig(model=tiny_path, device="meta", kv_cache_dtype="fp8_e4m3", dtype="float32"),
                          text_path=str(text), windows=2, window_len=96, progress=False)
    assert result["device"] == "meta" and result["tokens"] == 2 * 95


def test_bench_kernels_harness_keeps_to_the_gpu():
    from fp8cache.bench.kernels import KernelCase, run_kernel_bench

    cases = [KernelCase("fp8kv", "fp8_e4m3", torch.bfloat16), KernelCase("fp8kv", "auto", torch.bfloat16),
             KernelCase("torch_sdpa", "auto", torch.bfloat16)]
    with fake_gpu():
        rows = run_kernel_bench(shapes=((2, 64),), cases=cases, num_heads=8, num_kv_heads=2, head_size=64,
                                repeats=1, settle_ms=0, device="meta")
    assert [r["impl"] for r in rows] == ["fp8kv", "fp8kv", "torch_sdpa"]
    assert all(r["device"] == "meta" and r["bandwidth_probe"] == "copy" for r in rows)


def test_stand_in_catches_a_cpu_tensor_meeting_a_device_tensor():
    """The harness itself: what crashed on CUDA (a CPU index into a device tensor) raises here too."""
    with fake_gpu(), pytest.raises(RuntimeError, match="device"):
        table = torch.zeros(4, dtype=torch.long, device="meta")
        _ = table[torch.arange(2) % 4] * 16 + torch.arange(2)


def test_a_16_bit_model_gives_float32_logits_on_the_gpu(tiny_path):
    """Its output projection keeps cuBLAS's float32 sums (torch.mm's out_dtype) instead of rounding the logits to
    bfloat16, in eager steps and inside the decode graphs alike (the head is a module of the model)."""
    from fp8cache.model.cuda import float32_logits

    with fake_gpu():
        engine = _engine(tiny_path)
        runner = engine.runner
        head = runner.model.get_output_embeddings()
        assert isinstance(head, float32_logits.Float32Logits)
        assert head.head.weight is runner.model.get_input_embeddings().weight or not runner.hf_config.tie_word_embeddings
        hidden = torch.zeros(3, 5, runner.hf_config.hidden_size, dtype=torch.bfloat16, device="meta")
        logits = head(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (3, 5, runner.hf_config.vocab_size)
        engine.add_request("a", [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0, logprobs=2))
        _run(engine)
    with fake_gpu():  # a float32 model's head is left as it is
        engine = _engine(tiny_path, dtype="float32")
        assert type(engine.runner.model.get_output_embeddings()) is torch.nn.Linear


def test_the_overlapped_decode_loop_waits_for_nothing(default_shapes_path, monkeypatch):
    """The default on a GPU: 64 sequences of the default model's shapes decode with no host sync at all. Step
    N+1 is scheduled, its metadata copied (one non-blocking copy) and its forward pass and sampling queued before
    step N's tokens are read, and those come back through one non-blocking copy; N+1's input ids are N's tokens,
    copied on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(default_shapes_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    log: list[tuple[str, int]] = []
    with fake_gpu() as work:
        loaded = LoadedModel(model, AutoTokenizer.from_pretrained(default_shapes_path), model.config,
                             default_shapes_path)
        engine = _engine(default_shapes_path, loaded, kv_cache_memory="64MiB", max_num_seqs=64, kv_recent_window=0,
                         max_num_batched_tokens=2048, max_model_len=256)
        assert engine.overlap  # a device that queues its work
        for n in range(64):
            engine.add_request(str(n), [3 + n % 7] * 16, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        engine.step()  # the prefill, left in flight
        engine.trace = lambda what, number: log.append((what, number))
        to_device = step_metadata.to_device
        monkeypatch.setattr(step_metadata, "to_device",
                            lambda *args, **kwargs: log.append(("metadata", None)) or to_device(*args, **kwargs))
        work.reset()
        engine.step()  # the first decode step, launched before the prefill's tokens are read
        first = dict(work.ops), work.syncs, list(work.h2d)
        work.reset()
        outputs = engine.step()
    assert [what for what, _ in log] == ["schedule", "metadata", "launch", "read"] * 2
    assert [n for _, n in log] == [1, None, 1, 0, 2, None, 2, 1]
    assert len(outputs) == 64 and all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    for ops, syncs, h2d in (first, (dict(work.ops), work.syncs, work.h2d)):
        assert syncs == 0
        assert len(h2d) == 1 and all(h2d)  # the step's metadata
        assert ops["index_copy_"] == 1 and ops["index_select"] == 1  # the previous tokens into the input ids
        assert ops["argmax"] == 1 and ops["copy_"] == 1  # greedy sampling; its tokens to the host, not waited for
