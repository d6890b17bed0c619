"""The engine on a GPU, held to transformers and to the same engine on the CPU. Skipped where torch sees no GPU
(every CI machine): run on a machine with one by scripts/gpu_check.sh. FP8KV_TEST_GPU_DEVICE=cpu runs the
same tests CPU against CPU, to check the tests themselves.

The model: the default model when it is at hand (converted already, or FP8KV_DEFAULT_MODEL_WHEEL), else a random
model of its shapes (SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import build_tiny_tokenizer

from fp8cache import LLM, SamplingParams
from fp8cache.engine.sampling_params import StructuredOutputsParams

DEVICE = os.environ.get("FP8KV_TEST_GPU_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="no GPU visible to torch (CUDA or ROCm)")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]


def _default_model() -> str | None:
    from fp8cache.model import default_model

    try:
        if os.environ.get("FP8KV_DEFAULT_MODEL_WHEEL") or default_model.is_converted(
                default_model.default_model_dir()):
            return default_model.ensure_default_model(progress=False)
    except Exception:  # noqa: BLE001 - no default model: the random one below
        return None
    return None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    found = _default_model()
    if found:
        return found
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("default-shapes-random")
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         initializer_range=0.05)  # a little wider than 0.02: decided logits, fewer near-ties
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def _prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    return [i if len(i) >= 4 else i + [5, 6, 7, 8] for i in ids]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 24, **params) -> list[list[int]]:
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in out]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions before each pair's first difference (a difference sends the two apart)."""
    same = total = 0
    for x, y in zip(a, b):
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        same, total = same + first, total + len(x)
    return same / total


def test_auto_cache_float32_follows_transformers_greedy(model_path):
    """Teacher-forced: transformers' own float32 forward over prompt + fp8kv's greedy tokens picks the same token
    at every step where its top two differ by more than rounding, and fp8kv's logprobs match its log-softmax."""
    from transformers import AutoModelForCausalLM

    with LLM(model=model_path, device=DEVICE, dtype="float32", kv_cache_dtype="auto", log=lambda m: None) as llm:
        prompts = _prompt_ids(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True).to(DEVICE).eval()
    checked = 0
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens], device=DEVICE)).logits[0, len(prompt) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1)
        top2 = logprobs.topk(2, dim=-1).values
        for step, token in enumerate(tokens):
            ours = out.outputs[0].logprobs[step][token].logprob
            assert abs(ours - float(logprobs[step, token])) < 2e-3, f"step {step}: logprob {ours} vs transformers"
            if float(top2[step, 0] - top2[step, 1]) > 1e-3:
                assert token == int(logprobs[step].argmax()), f"step {step}: greedy token differs"
                checked += 1
    assert checked >= len(prompts) * 12


@pytest.mark.parametrize("kv_cache_dtype,window", [("fp8_e4m3", 32), ("fp8_e4m3", 0), ("fp8_e5m2", 32),
                                                   ("fp8_e4m3fnuz", 0), ("auto", 0)])
def test_every_cache_dtype_decodes_as_on_the_cpu(model_path, kv_cache_dtype, window):
    """The same FP8 bytes (quantization is bit-exact) and the same softmax, in another summation order: the GPU's
    greedy tokens, scored by the CPU engine (teacher-forced, decode-faithful prompt logprobs over the same
    cache dtype and window), get the logprobs the GPU gave them. Token by token agreement is no test: an
    upstream rounding difference (cuBLAS vs the CPU's matmuls) may move a value across an FP8 rounding
    boundary and, at a near tie, send the two greedy continuations apart."""
    config = {"model": model_path, "dtype": "float32", "kv_cache_dtype": kv_cache_dtype,
              "kv_recent_window": window, "log": lambda m: None}
    with LLM(device=DEVICE, **config) as llm:
        prompts = _prompt_ids(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))
    with LLM(device="cpu", **config) as llm:
        scored = llm.generate([{"prompt_token_ids": p + o.outputs[0].token_ids} for p, o in zip(prompts, outs)],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
    diffs = []
    for prompt, out, ref in zip(prompts, outs, scored):
        for step, token in enumerate(out.outputs[0].token_ids):
            gpu = out.outputs[0].logprobs[step][token].logprob
            cpu = ref.prompt_logprobs[len(prompt) + step][token].logprob
            diffs.append(abs(gpu - cpu))
    diffs = torch.tensor(diffs)
    print(f"{kv_cache_dtype} window {window}: |logprob(gpu) - logprob(cpu)| mean {diffs.mean():.2e}, "
          f"max {diffs.max():.2e}")
    assert float(diffs.mean()) < 0.02 and float(diffs.max()) < 0.5


def test_engine_features_on_the_gpu(model_path, tmp_path):
    """Prefix caching, chunked prefill, preemption, logprobs, structured outputs, per-KV-head and
    Hadamard-rotated scales on the GPU: every request finishes as asked. (A 3 MiB cache, about 270 tokens,
    without a recent-token window, whose seats would take most of it: the long requests preempt each other.)"""
    scales = tmp_path / "scales.json"
    per_head = [[0.05, 0.07, 0.06]] * 30
    scales.write_text(json.dumps({"model_type": "llama", "kv_rotation": "hadamard", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {str(i): 0.07 for i in range(30)}},
        "k_scaling_factor": {"0": {str(i): h for i, h in enumerate(per_head)}},
        "v_scaling_factor": {"0": {str(i): h for i, h in enumerate(per_head)}}}}))
    choices = ["city", "river", "water"]  # words of both the default model's and the test tokenizer's vocabulary
    with LLM(model=model_path, device=DEVICE, dtype="float32", kv_cache_dtype="fp8_e4m3",
             quantization_param_path=str(scales), max_num_batched_tokens=64, kv_cache_memory="3MiB",
             kv_recent_window=0, max_model_len=512, log=lambda m: None) as llm:
        tok = llm.get_tokenizer()
        shared = tok.encode("the city of water and music " * 20)[:120]
        llm.generate({"prompt_token_ids": shared + [5, 6]},
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs = llm.generate(
            [{"prompt_token_ids": shared + [7, 8]}] + [{"prompt_token_ids": [9 + n] * 150} for n in range(4)]
            + [{"prompt_token_ids": [5, 6, 7]}],
            [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
            + [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, ignore_eos=True, seed=n) for n in range(4)]
            + [SamplingParams(temperature=0, max_tokens=6,
                              structured_outputs=StructuredOutputsParams(choice=choices))])
        stats = llm.engine.stats
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0
    assert len(outs[0].outputs[0].token_ids) == 40
    assert all(len(entry) >= 2 and all(torch.isfinite(torch.tensor(lp.logprob)) for lp in entry.values())
               for entry in outs[0].outputs[0].logprobs)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs[1:5])
    assert outs[5].outputs[0].text.strip() in choices


def test_cuda_graphs_decode_as_eager_steps(model_path):
    runs = []
    for eager in (True, False):
        with LLM(model=model_path, device=DEVICE, dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=eager,
                 log=lambda m: None) as llm:
            runs.append(_greedy(llm, _prompt_ids(llm) * 3))
    assert _agreement(runs[0], runs[1]) >= 0.95


def test_gpu_kv_budget_follows_gpu_memory(model_path):
    """Without kv_cache_memory the GPU cache is sized for max_num_seqs x max_model_len, within
    gpu_memory_utilization of the GPU's memory (not the host's)."""
    lines: list[str] = []
    with LLM(model=model_path, device=DEVICE, kv_cache_dtype="fp8", max_num_seqs=8, max_model_len=2048,
             log=lines.append) as llm:
        runner = llm.engine.runner
        assert runner.capacity_tokens >= 8 * 2048
        assert runner.dtype == (torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    text = "\n".join(lines)
    assert "device: " in text and "op library: " in text


def test_bfloat16_logits_are_the_float32_sums_of_the_output_projection(model_path):
    """A bfloat16 model's logits are not rounded to bfloat16: they equal the float32 product of its bfloat16
    hidden states and head weight (cuBLAS's sums), on the device and through the engine's head."""
    from fp8cache.model.cuda import float32_logits

    llm = LLM(model=model_path, device=DEVICE, dtype="bfloat16", kv_cache_memory="256MiB", log=lambda m: None)
    head = llm.engine.runner.model.get_output_embeddings()
    if DEVICE == "cpu":
        assert head.float32_out
        weight = llm.engine.runner.model.get_input_embeddings().weight
    else:
        assert isinstance(head, float32_logits.Float32Logits)
        weight = head.head.weight
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, weight.shape[1], generator=generator).bfloat16().to(weight.device)
    got = head(hidden)
    want = hidden.float() @ weight.float().t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert not torch.equal(got, got.bfloat16().float())  # not rounded to bfloat16


def test_overlapped_loop_gives_the_synchronous_loops_tokens(model_path):
    """The default decode loop on a GPU queues step N+1 (CUDA graph replay included) before it reads step N's
    tokens, which N+1 takes as input ids on the device. Greedy tokens are the synchronous loop's: these requests
    start and end together, so both loops run the same batches through the same kernels. Stop token ids, seen a
    step late, end the outputs at the same token, and no block is left behind."""
    with LLM(model=model_path, device=DEVICE, dtype="bfloat16", kv_cache_dtype="fp8", log=lambda m: None) as llm:
        engine = llm.engine
        assert engine.overlap == (DEVICE != "cpu")
        prompts = _prompt_ids(llm) * 4
        runs = []
        for overlap in (False, True):
            engine.overlap = overlap
            plain = _greedy(llm, prompts)
            stops = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[5]]) for tokens in plain]
            stopped = llm.generate([{"prompt_token_ids": p} for p in prompts], stops)
            runs.append((plain, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in stopped]))
            assert engine.stats.blocks_used == 0
    assert runs[1] == runs[0]
    assert all(reason == "stop" and tokens[-1] == plain[5] for (tokens, reason), plain in zip(runs[0][1], runs[0][0]))
