"""Random weights for benchmarks, as vLLM's `--load-format dummy`: a model from its config.json alone.

The model is built on torch's meta device (no memory), then every parameter is allocated on the target device
and filled there, so a 16 GB model never passes through host memory and needs no weight files. Linear and
embedding weights (and biases) are normal(0, initializer_range), as the model was initialised before
training; norm weights are 1 and norm biases 0, so that every layer's activations stay of the order of one
(a random norm scale would shrink or blow them up layer after layer). Each parameter's values come from a
generator seeded by its name: two builds on one device hold the same weights (the transformers peer of
`bench throughput` runs the same model as fp8kv), and so do the parameters every tensor-parallel rank keeps
whole (embeddings, norms, the output projection).

Named shapes: model/shapes.py. Their tokenizer is a byte-level one built here, whose vocabulary spans the
model's so every id the random model emits decodes.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from torch import nn

SEED = 0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# A plain chat template, so that chat routes work on a random model too.
_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def has_tokenizer(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


# ---- tokenizer -------------------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (byte b -> symbols[b]), as ByteLevel pre-tokenizers use."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def byte_tokenizer(hf_config: object):
    """A byte-level BPE tokenizer without merges for a model without one: token b < 256 is byte b, every
    other id up to the model's vocabulary a reserved token (its text is its name), so any id decodes. The
    config's BOS and EOS ids, when above the bytes, are the tokenizer's BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = max(int(getattr(hf_config, "vocab_size", 0) or 0), 256 + 3)
    names = _byte_symbols() + [f"<|reserved_{i}|>" for i in range(256, vocab_size)]
    specials = {}
    for role, default_id in (("bos", vocab_size - 3), ("eos", vocab_size - 2), ("pad", vocab_size - 1)):
        value = getattr(hf_config, f"{role}_token_id", None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        token_id = value if isinstance(value, int) and 256 <= value < vocab_size else default_id
        if names[token_id].startswith("<|reserved_"):
            names[token_id] = f"<|{role}|>"
        specials[f"{role}_token"] = names[token_id]
    tok = Tokenizer(models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


# ---- weights ---------------------------------------------------------------------------------------


def build_model(hf_config: object, dtype: torch.dtype, device: torch.device | str,
                trust_remote_code: bool = False) -> nn.Module:
    """The config's causal LM in `dtype` with random weights on `device` (meta: shapes only, for a tensor-
    parallel rank to shard before materialize() fills its share on its own device)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # Parameters on meta, buffers (rotary frequencies) computed for real: they are small and not random.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # from_config leaves meta parameters untied (tie_word_embeddings models)
    model.eval()
    if torch.device(device).type != "meta":
        materialize(model, device)
        model.to(device)  # anything a model keeps outside parameters and buffers (none in Llama or Qwen2)
    return model


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device | str, seed: int = SEED) -> None:
    """Give every meta parameter memory on `device` and random values (see the module's docstring), keeping
    shared (tied) parameters shared; move the buffers there too."""
    device = torch.device(device)
    std = float(getattr(getattr(model, "config", None), "initializer_range", None) or 0.02)
    names = {id(p): name for name, p in model.named_parameters()}  # the first name of a tied parameter
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                _fill(data, names.get(id(param), key), key, _is_norm(module), std, seed)
                made[id(param)] = nn.Parameter(data, requires_grad=False)
            module._parameters[key] = made[id(param)]
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and not buf.is_meta:
                module._buffers[key] = buf.to(device)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


@torch.no_grad()
def _fill(data: torch.Tensor, name: str, key: str, norm: bool, std: float, seed: int) -> None:
    if norm:
        data.fill_(1.0 if key == "weight" else 0.0)
        return
    gen = torch.Generator(device=data.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    data.normal_(0.0, std, generator=gen)
