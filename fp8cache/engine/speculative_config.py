"""speculative_config: vLLM's shape, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": m,
"prompt_lookup_max": M}. Only n-gram (prompt lookup) speculation exists here: it needs no second model.

Defaults: prompt_lookup_min 2 (a single matching token proposes too much that is rejected), capped by a given
max; prompt_lookup_max 4, raised to a given min. Longer n-grams are tried first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")
# Above this many running sequences a step decodes plainly. A verify step's linears cost in proportion to its rows
# once they are compute-bound, so speculation gains in small batches: on a CPU up to 8 sequences verify a draft
# or more within the rows a step costs anyway (spec_decode.VERIFY_ROWS_CPU), 9 or more would verify none.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_DEFAULT_MIN, _DEFAULT_MAX = 2, 4


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # K: the most tokens proposed (and verified) per sequence and step
    prompt_lookup_min: int  # shortest n-gram matched
    prompt_lookup_max: int  # longest n-gram matched (tried first)
    method: str = "ngram"
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE  # no proposals while more sequences run (vLLM's name)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The config from a dict or its JSON text (None or {}: speculation off); ValueError naming the fix."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc}); give e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (dict), got {type(value).__name__}")  # noqa: TRY004 - a config error, as the CLI reports it
        if not value:
            return None
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; use \"ngram\" (prompt "
                             "lookup, no draft model)")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (e.g. 4): how many tokens to propose")
        k = _whole(value, "num_speculative_tokens")
        low = _whole(value, "prompt_lookup_min") if value.get("prompt_lookup_min") is not None else None
        high = _whole(value, "prompt_lookup_max") if value.get("prompt_lookup_max") is not None else None
        low = low if low is not None else min(_DEFAULT_MIN, high or _DEFAULT_MIN)
        high = high if high is not None else max(_DEFAULT_MAX, low)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) is above prompt_lookup_max ({high}); "
                             "the n-gram lengths tried are [min, max]")
        batch = _whole(value, "disable_by_batch_size") if value.get("disable_by_batch_size") is not None \
            else DEFAULT_DISABLE_BY_BATCH_SIZE
        return cls(k, low, high, method, batch)

    def describe(self) -> str:
        return (f"speculative decoding: {self.method}, up to {self.num_speculative_tokens} tokens a step from "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}-gram prompt lookup, while at most "
                f"{self.disable_by_batch_size} sequences run")


def _whole(value: dict, key: str) -> int:
    n = value[key]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"speculative_config {key} must be a whole number >= 1, got {n!r}")
    return n
