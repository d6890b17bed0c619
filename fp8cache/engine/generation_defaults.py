"""Request defaults from the model's generation_config.json, as vLLM's `--generation-config` and
`--override-generation-config` make them.

The model's creator recommends sampling settings there (temperature, top_p, top_k, min_p, repetition_penalty)
and a length (max_new_tokens). They fill what a request leaves out; a request's own field always wins.
`vllm` (or `none`) ignores the file: fp8kv's neutral defaults (temperature 1, no top-p/top-k/min-p, no
penalty). Overrides replace single fields of whichever was chosen, as in vLLM.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fp8cache.engine.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
NEUTRAL_CHOICES = ("vllm", "none")
# The fields vLLM takes from a generation config; max_new_tokens is Hugging Face's name for max_tokens.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FIELDS = (*SAMPLING_FIELDS, "max_new_tokens")
# The server's cap on new tokens for a request that does not say how many (`fp8kv run --default-max-tokens`).
# Without one, such a request runs to the end of the context: 8,155 tokens and 6 minutes for the default model
# on 2 cores. 1024 tokens hold a long chat answer, and took 19 s there (2 busy EPYC cores, 2026-11-29); a
# larger model takes longer in proportion to its decode speed. --default-max-tokens 0 lifts the cap.
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a field out gets."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments
    max_new_tokens: int | None = None  # None: the model does not say
    source: str = "fp8kv's own"  # where the values come from, for the start's log line

    def sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams of these defaults with the given fields on top (vLLM's get_default_sampling_params
        when none are given)."""
        length = {"max_tokens": self.max_new_tokens} if self.max_new_tokens is not None else {}
        return SamplingParams(**(self.sampling | length | given))

    def describe(self) -> str:
        values = self.sampling | ({"max_new_tokens": self.max_new_tokens} if self.max_new_tokens else {})
        if not values:
            return f"fp8kv's neutral ones, temperature 1 and no top-p/top-k/min-p/penalty ({self.source})"
        return ", ".join(f"{k}={v}" for k, v in values.items()) + f" (from {self.source})"


def parse_overrides(value: str | dict | None) -> dict[str, Any]:
    """An override as a dict of known fields: a JSON object text, or a dict (LLM(override_generation_config=...))."""
    what = "--override-generation-config"
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: not valid JSON ({exc.msg} at character {exc.pos}); give a JSON object, "
                             "e.g. '{\"temperature\": 0.7}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: must be a JSON object of fields, e.g. '{{\"temperature\": 0.7}}'")  # noqa: TRY004 - a bad flag value, as the CLI reports it
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {', '.join(unknown)}; the fields a generation config sets "
                         f"here are {', '.join(FIELDS)}")
    return dict(value)


def check_generation_flags(choice: str, overrides: str | dict | None) -> None:
    """What can fail before the model loads: the override's JSON, and a --generation-config folder without
    the file."""
    parse_overrides(overrides)
    if choice != "auto" and choice not in NEUTRAL_CHOICES:
        _folder_file(choice)


def _folder_file(choice: str) -> str:
    path = os.path.join(os.path.expanduser(choice), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--generation-config {choice}: no {GENERATION_CONFIG_FILE} in that folder; give a folder "
                         "that holds one, auto (the model's) or vllm (fp8kv's neutral defaults)")
    return path


def load_generation_defaults(choice: str, model_path: str | None,
                             overrides: str | dict | None = None) -> GenerationDefaults:
    """choice: `auto` (the model folder's generation_config.json, if it has one), `vllm`/`none` (neutral), or
    a folder holding a generation_config.json. Bad values fail here, at start, naming the file or the flag."""
    extra = parse_overrides(overrides)
    if choice in NEUTRAL_CHOICES:
        values, source = {}, f"--generation-config {choice}"
    elif choice != "auto":
        path = _folder_file(choice)
        values, source = _read(os.path.dirname(path)), path
    elif model_path and os.path.isfile(os.path.join(model_path, GENERATION_CONFIG_FILE)):
        values, source = _read(model_path), os.path.join(model_path, GENERATION_CONFIG_FILE)
    else:
        values, source = {}, f"the model folder has no {GENERATION_CONFIG_FILE}"
    if extra:
        values |= extra
        source += f", with --override-generation-config {json.dumps(extra)}"
    elif not values and os.path.isfile(source):
        source += " sets none of them"
    return _checked(values, source)


def _read(folder: str) -> dict[str, Any]:
    from transformers import GenerationConfig

    with _quiet_transformers():  # it warns that sampling fields without do_sample "may be ignored"; vLLM uses them
        config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return {name: getattr(config, name) for name in FIELDS if getattr(config, name, None) is not None}


def _checked(values: dict[str, Any], source: str) -> GenerationDefaults:
    sampling = {k: values[k] for k in SAMPLING_FIELDS if values.get(k) is not None}
    max_new_tokens = values.get("max_new_tokens")
    defaults = GenerationDefaults(sampling, max_new_tokens, source)
    try:
        defaults.sampling_params()  # every value in its range, as a request's would be
    except ValueError as exc:
        raise ValueError(f"generation defaults from {source}: {exc}".replace("SamplingParams.", "")
                         .replace("max_tokens=", "max_new_tokens=")) from None
    return defaults


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    logger = logging.getLogger("transformers.generation.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def default_max_tokens(room: int, server_cap: int, model_max_new_tokens: int | None) -> int:
    """New tokens for a request that does not say: the room left in the context, capped by the server's
    --default-max-tokens (0: no cap) and by the model's max_new_tokens when that is smaller."""
    return min([room] + [c for c in (server_cap, model_max_new_tokens) if c])


def describe_cap(server_cap: int, model_max_new_tokens: int | None) -> str:
    """The start's log line's words for default_max_tokens."""
    caps = ([f"{server_cap} (--default-max-tokens)"] if server_cap else []) + (
        [f"{model_max_new_tokens} (the generation config's max_new_tokens)"] if model_max_new_tokens else [])
    return "the room left in the context" + (f", at most {' and '.join(caps)}" if caps else "")
