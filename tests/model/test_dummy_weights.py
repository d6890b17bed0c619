"""--load-format dummy: models from config.json alone with random weights made on the device, the shapes shipped
with fp8kv, their byte-level tokenizer, and the commands that take (or refuse) the flag.

References: the parameter counts published for each model, the shapes issue 37 names, transformers running the
same random weights, and the text the tokenizer was given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig

from fp8cache.config import EngineConfig
from fp8cache.model import dummy, loader, shapes

# Published parameter counts (the models' safetensors metadata / model cards).
PUBLISHED = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512,
             "smollm2-135m": 134_515_008}
# (layers, hidden, heads, KV heads, head size, MLP, vocabulary) as issue 37 lists them.
SHAPES = {"llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256), "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944, 152064),
          "llama-3.1-70b": (80, 8192, 64, 8, 128, 28672, 128256), "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152)}
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 600, "max_position_embeddings": 512, "bos_token_id": 300, "eos_token_id": 301,
        "tie_word_embeddings": False}


def write_config(folder: Path, **overrides) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY, **overrides}))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    """A folder holding only a config.json: no weights, no tokenizer."""
    return write_config(tmp_path_factory.mktemp("config-only"))


# ---- shapes ----------------------------------------------------------------------------------------


def test_every_shipped_shape_has_its_published_size():
    assert shapes.shape_names() == sorted(PUBLISHED)
    for name, count in PUBLISHED.items():
        cfg = AutoConfig.from_pretrained(shapes.shape_path(name))
        model = dummy.build_model(cfg, torch.bfloat16, "meta")  # shapes only: 70B in no memory at all
        assert sum(p.numel() for p in model.parameters()) == count, name
        layers, hidden, heads, kv_heads, head_size, mlp, vocab = SHAPES[name]
        attention = model.model.layers[0].self_attn
        assert (len(model.model.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                cfg.intermediate_size, cfg.vocab_size) == (layers, hidden, heads, kv_heads, mlp, vocab)
        assert attention.k_proj.weight.shape == (kv_heads * head_size, hidden)
        assert (attention.q_proj.bias is not None) == (name == "qwen2.5-7b")  # Qwen2's q/k/v biases


def test_shape_names_resolve_only_with_load_format_dummy(tmp_path, monkeypatch):
    assert loader.resolve_model_path("Llama-3.1-8B", load_format="dummy") == shapes.shape_path("llama-3.1-8b")
    with pytest.raises(loader.ModelLoadError, match=r"ships without weights.*--load-format dummy"):
        loader.resolve_model_path("llama-3.1-8b")
    assert loader.resolve_model_path(None, load_format="dummy") == shapes.shape_path(shapes.DEFAULT_SHAPE)
    # A folder of that name here is that folder, whatever the format.
    monkeypatch.chdir(tmp_path)
    own = write_config(tmp_path / "llama-3.1-8b")
    assert loader.resolve_model_path("llama-3.1-8b", load_format="dummy") == own
    with pytest.raises(loader.ModelLoadError, match=r"no \*\.safetensors weights"):
        loader.resolve_model_path("llama-3.1-8b")  # a config alone needs dummy
    with pytest.raises(loader.ModelLoadError, match=r"holding a config\.json .* llama-3\.1-8b"):
        loader.resolve_model_path(str(tmp_path / "nothing-here"), load_format="dummy")
    with pytest.raises(ValueError, match=r"load_format='safetensors' is not known; valid: auto .* dummy"):
        loader.resolve_model_path(own, load_format="safetensors")


# ---- weights ---------------------------------------------------------------------------------------


def test_random_weights_are_real_repeatable_and_keep_activations_finite(tiny_config):
    cfg = AutoConfig.from_pretrained(tiny_config)
    model = dummy.build_model(cfg, torch.float32, "cpu")
    again = dummy.build_model(cfg, torch.float32, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # normal(0, initializer_range): a 128 x 128 matrix's std is within a few % of it
            assert p.std().item() == pytest.approx(cfg.initializer_range, rel=0.1), name
    q0, q1 = (model.model.layers[i].self_attn.q_proj.weight for i in (0, 1))
    assert not torch.equal(q0, q1)  # each parameter its own seed
    rope = model.model.rotary_emb.inv_freq  # computed, not random: base ** (-2i / d), Llama's base 10000
    assert torch.allclose(rope, 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float32) / 32))


def test_deep_random_models_stay_finite_in_bfloat16(tmp_path):
    """Norm weights of 1 keep each layer's input at unit scale: 48 layers in bfloat16 give finite, spread
    logits (random norm scales would shrink or blow the residual stream up layer after layer)."""
    cfg = AutoConfig.from_pretrained(write_config(tmp_path, num_hidden_layers=48, hidden_size=256,
                                                  intermediate_size=704, num_attention_heads=8,
                                                  num_key_value_heads=2))
    model = dummy.build_model(cfg, torch.bfloat16, "cpu")
    with torch.no_grad():
        logits = model(torch.arange(64).view(1, 64)).logits.float()
    assert logits.isfinite().all() and 0.1 < logits.std().item() < 100


def test_tied_embeddings_stay_tied():
    cfg = AutoConfig.from_pretrained(shapes.shape_path("smollm2-135m"))
    cfg.num_hidden_layers = 1  # the default model's embedding, one layer of it
    model = dummy.build_model(cfg, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_tensor_parallel_share_is_filled_after_sharding(tiny_config, monkeypatch):
    """A rank loads shapes only (meta), keeps its share, then to_device() fills that share on its device: the
    parameters every rank keeps whole are those of the whole model, bit for bit, so every rank computes the
    same embeddings, norms and logits."""
    from fp8cache.distributed import sharding

    config = EngineConfig(model=tiny_config, load_format="dummy", device="cpu", dtype="float32")
    whole = loader.load_model(config).model
    share = loader.load_model(config, on_device=False).model
    assert all(p.is_meta for p in share.parameters())
    sharding.shard_model(share, share.config, 1, 2)
    loader.to_device(share, "cpu")
    assert not any(p.is_meta for p in share.parameters())
    assert share.model.layers[0].self_attn.q_proj.weight.shape == (2 * 32, 128)  # 2 of the 4 heads
    assert share.model.layers[0].mlp.down_proj.weight.shape == (128, 128)  # half the MLP width
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.1.input_layernorm.weight"):
        assert torch.equal(share.get_parameter(name), whole.get_parameter(name)), name


@pytest.mark.slow
def test_two_ranks_run_the_model_their_shares_make(tiny_config):
    """LLM(tensor_parallel_size=2, load_format="dummy"): each rank fills its share from the parameter's seed, so
    both ranks hold the same values for their halves. The model that makes is the whole model with each split
    parameter twice that half; transformers running it gives the ranks' greedy tokens."""
    from fp8cache import LLM
    from fp8cache.bench import throughput
    from fp8cache.distributed import sharding

    config = EngineConfig(model=tiny_config, load_format="dummy", device="cpu", dtype="float32")
    reference = loader.load_model(config).model
    share = loader.load_model(config, on_device=False).model
    sharding.shard_model(share, share.config, 0, 2)
    loader.to_device(share, "cpu")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            half = share.get_parameter(name)
            if half.shape != p.shape:
                p.copy_(torch.cat([half, half], dim=0 if half.shape[0] != p.shape[0] else 1))
    prompts = [[5, 17, 99, 200, 31, 7, 64, 12], [250, 3, 3, 140, 77, 90, 18, 41]]
    with LLM(model=tiny_config, load_format="dummy", dtype="float32", device="cpu", kv_cache_memory="4MiB",
             tensor_parallel_size=2, log=lambda m: None) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, throughput.bench_params(5))]
    with torch.inference_mode():
        theirs = reference.generate(torch.tensor(prompts), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                    pad_token_id=0)
    assert ours == theirs[:, 8:].tolist()


@pytest.mark.slow
def test_bench_throughput_over_two_ranks_shares_one_random_model_between_its_engines(tiny_config):
    """Several engines on a tensor-parallel rank share one load: with random weights it stays shapes only until
    the first runner fills the rank's share (a 70B model is never whole on any GPU)."""
    from launcher import bench as bench_commands

    result = CliRunner().invoke(bench_commands.throughput, [
        tiny_config, "--load-format", "dummy", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
        "--kv-cache-dtype", "auto,fp8_e4m3", "--num-shard", "2", "--threads", "1", "--kv-cache-memory", "4MiB",
        "--dtype", "float32", "--device", "cpu", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["kv_cache_dtype"], r["num_shard"], r["output_tokens"]) for r in rows] == [
        ("auto", 2, 8), ("fp8_e4m3", 2, 8)]
    per_rank = TINY["num_hidden_layers"] * 2 * (TINY["num_key_value_heads"] // 2) * TINY["head_dim"]
    assert [r["bytes_per_token"] for r in rows] == [4 * per_rank, per_rank]


# ---- tokenizer -------------------------------------------------------------------------------------


def test_the_byte_tokenizer_round_trips_text_and_decodes_every_id():
    from fp8cache.quality.eval import locate_eval_text, read_text

    cfg = AutoConfig.from_pretrained(shapes.shape_path("llama-3.1-8b"))
    tok = dummy.byte_tokenizer(cfg)
    text = read_text(locate_eval_text())[:20_000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # one token a byte
    assert tok.decode(ids) == text
    assert len(tok) == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)  # the config's
    assert tok.decode([ord("H"), 5000, ord("i")]) == "H<|reserved_5000|>i"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|user|>\nHi") and chat.endswith("<|assistant|>\n")


def test_a_folder_with_its_own_tokenizer_keeps_it(tmp_path):
    from conftest import TINY_WORDS, build_tiny_tokenizer  # tests/conftest.py, on sys.path

    folder = Path(write_config(tmp_path, vocab_size=3 + len(TINY_WORDS)))
    build_tiny_tokenizer().save_pretrained(folder)
    loaded = loader.load_model(EngineConfig(model=str(folder), load_format="dummy", device="cpu"))
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the city", add_special_tokens=False)) == "the city"
    assert len(loaded.tokenizer) == 3 + len(TINY_WORDS)
    assert loaded.checkpoint_scale_tensors == {}


# ---- the engine and transformers on the same random weights -------------------------------------------


def test_the_engine_and_the_transformers_peer_generate_the_same_greedy_tokens(tiny_config):
    """bench throughput's peer (peer_model) is transformers on the very weights fp8kv loaded: greedy, both
    generate the same tokens."""
    from fp8cache import LLM
    from fp8cache.bench import throughput

    prompts = [[5, 17, 99, 200, 31, 7, 64, 12], [250, 3, 3, 140, 77, 90, 18, 41]]
    llm = LLM(model=tiny_config, load_format="dummy", dtype="float32", device="cpu", kv_cache_memory="4MiB",
              log=lambda m: None)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, throughput.bench_params(6))]
    peer = throughput.peer_model(tiny_config, torch.float32, "cpu", load_format="dummy")
    with torch.inference_mode():
        theirs = peer.generate(torch.tensor(prompts), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                               pad_token_id=0)
    assert ours == theirs[:, 8:].tolist()


# ---- commands --------------------------------------------------------------------------------------


def test_eval_refuses_random_weights():
    from launcher.cli import main

    result = CliRunner().invoke(main, ["eval", "llama-3.1-8b", "--load-format", "dummy"])
    assert result.exit_code == 2
    assert "random weights" in result.output and "drop --load-format dummy" in result.output


def test_a_shape_without_load_format_dummy_is_one_clear_error():
    from launcher.cli import main

    for args in (["bench", "throughput", "qwen2.5-7b", "--device", "cpu"],
                 ["generate", "qwen2.5-7b", "hello", "--device", "cpu"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "--load-format dummy" in result.output and "Traceback" not in result.output


def test_generate_runs_random_weights_from_a_config(tiny_config):
    from launcher.cli import main

    result = CliRunner().invoke(main, ["generate", tiny_config, "the capital", "--load-format", "dummy",
                                       "--device", "cpu", "--kv-cache-memory", "4MiB", "--max-tokens", "4",
                                       "--no-chat"])
    assert result.exit_code == 0, result.output


def test_bench_serve_cuts_prompts_with_the_servers_byte_tokenizer(tiny_config):
    from fp8cache.bench import serve

    for source in ("llama-3.1-8b", tiny_config):
        tok = serve.load_tokenizer(source)
        assert tok("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]
    assert len(serve.load_tokenizer(tiny_config)) == TINY["vocab_size"]


def test_the_load_format_flag_reaches_the_engine_config():
    """run, generate and systemd-unit share the engine flags; a unit keeps the flag (and a shape name)."""
    from launcher.cli import main

    result = CliRunner().invoke(main, ["systemd-unit", "llama-3.1-8b", "--load-format", "dummy", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    exec_line = next(line for line in result.output.splitlines() if line.startswith("ExecStart="))
    assert "run llama-3.1-8b" in exec_line and "--load-format dummy" in exec_line
