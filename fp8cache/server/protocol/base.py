"""What the request bodies of every API share: the strict base model, the size limits, and the field
checks that more than one body uses."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_LOGPROBS = 20  # top logprobs per token (SamplingParams allows as many)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 512
MAX_MESSAGES = 4096
INT64_MAX = 2**63 - 1


class Strict(BaseModel):
    """A request body: JSON types must match exactly, unknown fields are refused, and JSON null for a field
    that has a default means "not set" (clients such as TGI's and OpenAI's generated ones send every optional
    field, null when unset: `"n": null` is n's default, not a type error)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        optional = _optional_keys(cls)
        return {k: v for k, v in data.items() if v is not None or k not in optional}


def _optional_keys(model: type[BaseModel]) -> set[str]:
    """The JSON keys of model's fields that have a default (a required field's null stays a type error)."""
    keys = set()
    for name, field in model.model_fields.items():
        if not field.is_required():
            keys.update({name, field.alias or name})
    return keys


def _is_unset(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def refuse_if_set(*names: str):
    """A validator for fields fp8kv cannot honour: absent, null, false or empty passes; anything else fails."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if not _is_unset(value):
            raise ValueError(f"{info.field_name} is not supported by fp8kv; remove it from the request")
        return value

    return field_validator(*names)(classmethod(check))


def only_with(name: str, flag: str, message: str):
    """A validator for a field that means something only beside another: `name` given (not null) while `flag`,
    declared before it, is not true fails with `message`."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get(flag):
            raise ValueError(message)
        return value

    return field_validator(name)(classmethod(check))


def check_stop(value: Any, *, allow_str: bool) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) and allow_str:
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("must be " + ("a string or " if allow_str else "") + "an array of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise ValueError(f"has {len(value)} sequences; at most {MAX_STOP_SEQUENCES} are allowed")
    for s in value:
        if not s:
            raise ValueError("stop sequences must not be empty strings")
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"a stop sequence has {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed")
    return value


def check_token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ValueError(f"{what} must be an array of integer token ids")
    if any(t < 0 for t in value):
        raise ValueError(f"{what} must not contain negative token ids")
    return value
