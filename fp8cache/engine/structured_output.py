"""Structured outputs: a JSON schema, a regex or a list of choices the generated text must match.

outlines-core compiles the pattern into an automaton over the tokenizer's vocabulary (each token as the
bytes it adds to the text); each step the sequence's Guide says which tokens can continue a match, the
sampler masks the rest, and the sampled token advances the Guide. Once the match is complete the end of
sequence token is allowed (and, where nothing else is, the only choice).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Rust regex metacharacters: choices are matched literally.
_REGEX_META = re.compile(r"([\\.^$|?*+()\[\]{}])")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured output request: exactly one of json (a JSON schema, dict or string), regex, choice
    (the output is one of these strings) or json_object (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False
    # The compiled outlines Index, when it was compiled ahead (the server compiles in worker processes, where
    # a pathological pattern can be stopped); the engine then only makes guides from it.
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of json, regex, choice, json_object; "
                f"got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict or a JSON string)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("StructuredOutputsParams.regex must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")

    def with_compiled(self, index: Any) -> StructuredOutputsParams:
        """A copy that carries its compiled outlines Index."""
        out = copy.copy(self)
        object.__setattr__(out, "compiled", index)
        return out

    def to_regex(self) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(" + "|".join(_REGEX_META.sub(r"\\\1", c) for c in self.choice) + ")"
        schema = self.json if self.json is not None else {"type": "object"}
        try:
            return build_regex_from_schema(schema if isinstance(schema, str) else json.dumps(schema))
        except Exception as exc:  # noqa: BLE001 - outlines' message names what it cannot handle
            raise ValueError(f"the JSON schema cannot be used for structured output: {exc}") from None


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes each ordinary token adds to the text (special tokens left out), for byte-level BPE
    (GPT-2, Llama 3, Qwen2, SmolLM) and SentencePiece (Llama 2, Mistral: '▁' is a space, <0xNN> a byte)
    vocabularies."""
    special = set(tokenizer.all_special_ids)
    decoder = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__
    byte_level = decoder == "ByteLevel"
    unicode_to_byte = _unicode_to_byte()
    out = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        if byte_level:
            if all(c in unicode_to_byte for c in token):
                out[token_id] = bytes(unicode_to_byte[c] for c in token)
        elif (match := _BYTE_TOKEN.fullmatch(token)) is not None:
            out[token_id] = bytes([int(match.group(1), 16)])
        else:
            out[token_id] = token.replace("\u2581", " ").encode("utf-8")
    return out


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted past 255.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


class SequenceGuide:
    """One sequence's place in the automaton: which tokens may come next, and the step to the next state."""

    def __init__(self, automaton, tokenizer_size: int) -> None:
        self.automaton = automaton  # an outlines_core.Guide
        self.tokenizer_size = tokenizer_size

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size] (the model's logits width): the tokens that continue a match."""
        import numpy as np
        import torch  # here, so that grammar compile workers need not import torch

        # The automaton writes through a raw pointer: into numpy's memory, which is host memory whatever torch
        # mode is active (tests run the GPU paths under FakeTensorMode, whose tensors hold no data).
        words = np.zeros((max(vocab_size, self.tokenizer_size) + 31) // 32, dtype=np.uint32)
        self.automaton.write_mask_into(words.ctypes.data, words.size, 4)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def advance(self, token_id: int) -> None:
        self.automaton.advance(token_id, return_tokens=False)


class GuideFactory:
    """Per tokenizer: its outlines Vocabulary (built once) and compiled patterns (the last 64 kept)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._vocabulary = None
        self.compile = functools.lru_cache(maxsize=64)(self._compile)

    def guide(self, params: StructuredOutputsParams) -> SequenceGuide:
        """A fresh guide (one per sequence) for params; ValueError if the pattern cannot be compiled."""
        from outlines_core import Guide

        index = params.compiled if params.compiled is not None else self.compile(params.to_regex())
        return SequenceGuide(Guide(index), len(self.tokenizer))

    def _compile(self, regex: str):
        from outlines_core import Vocabulary

        if self._vocabulary is None:
            self._vocabulary = Vocabulary(*vocabulary_map(self.tokenizer))
        return compile_index(regex, self._vocabulary)


def vocabulary_map(tokenizer) -> tuple[int, dict[bytes, list[int]]]:
    """(eos id, {bytes: token ids}): what an outlines Vocabulary is built from."""
    eos = tokenizer.eos_token_id
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, piece in token_bytes(tokenizer).items():
        if token_id != eos:
            by_bytes.setdefault(piece, []).append(token_id)
    return eos, by_bytes


def compile_index(regex: str, vocabulary):
    """The outlines Index of regex over vocabulary; ValueError if the pattern cannot be compiled."""
    from outlines_core import Index

    try:
        return Index(regex, vocabulary)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - outlines says what is wrong with the pattern
        raise ValueError(f"the structured output pattern cannot be compiled: {exc}") from None


@functools.lru_cache(maxsize=4)
def factory_for(tokenizer) -> GuideFactory:
    return GuideFactory(tokenizer)
