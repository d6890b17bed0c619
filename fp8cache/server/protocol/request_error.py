"""RequestError, the one exception a refused request becomes, and the translation of pydantic's failures
into it. The HTTP answer it turns into (OpenAI's or TGI's error shape) is made in server/errors.py."""

from __future__ import annotations

from pydantic import ValidationError

from fp8cache.jsonkind import json_kind


class RequestError(Exception):
    """A request the server refuses; rendered in the OpenAI or the TGI error shape by errors.py."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type


# pydantic's failures of a value's type, said in JSON's words: its own say "a valid dictionary or instance of
# ResponseFormat", Python's names for what a client wrote as JSON.
_TYPE_WORDS = {
    "model_type": "an object", "model_attributes_type": "an object", "dict_type": "an object",
    "dataclass_type": "an object", "list_type": "an array", "tuple_type": "an array", "set_type": "an array",
    "frozen_set_type": "an array", "iterable_type": "an array", "string_type": "a string", "int_type": "an integer",
    "int_parsing": "an integer", "int_from_float": "an integer (no fraction)", "float_type": "a number",
    "float_parsing": "a number", "bool_type": "true or false", "bool_parsing": "true or false",
    "none_required": "null",
}
# The members of a union appear in pydantic's locations as tags ("str", "literal['none','auto']", a model's
# class name): none of them is a field the client wrote.
_BUILTIN_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


# The request models' class names (the tags pydantic puts in an error's location for a union's member),
# filled by the protocol package once its modules are imported (fp8cache/server/protocol/__init__.py).
MODEL_NAMES: set[str] = set()


def _is_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return (part in _BUILTIN_TAGS or "[" in part or part.startswith("function-")
            or part in MODEL_NAMES)


def _loc_name(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not _is_tag(part))


def _what_is_wrong(err: dict) -> tuple[str, str | None]:
    """(what the value must be, what it was in JSON's words or None) for one pydantic error."""
    if err["type"] in _TYPE_WORDS:
        return f"must be {_TYPE_WORDS[err['type']]}", json_kind(err.get("input"))
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return ("must be " + msg.removeprefix("Input should be ") if msg.startswith("Input should be ") else msg), None


def validation_error(exc: ValidationError, status: int = 400) -> RequestError:
    """One RequestError for a pydantic failure; names the first bad field and lists the others."""
    problems = []
    for err in exc.errors(include_url=False):
        name = _loc_name(err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            problems.append((name, "unknown field; remove it", None))
        elif err["type"] == "missing":
            problems.append((name, "is required", None))
        else:
            problems.append((name, *_what_is_wrong(err)))
    merged = _merge_same_field(problems)
    first = merged[0][0] if merged else None
    message = "; ".join(f"{name}: {msg}" for name, msg in merged[:5])
    if len(merged) > 5:
        message += f"; and {len(merged) - 5} more problems"
    return RequestError(message, status=status, param=first, code="invalid_value")


def _merge_same_field(problems: list[tuple[str, str, str | None]]) -> list[tuple[str, str]]:
    # A union field reports one failure per member ("must be a string", "must be an array"): say them as one,
    # "must be a string or an array, not a number".
    merged: dict[str, list[str]] = {}
    was: dict[str, str] = {}
    for name, msg, kind in problems:
        if msg not in merged.setdefault(name, []):
            merged[name].append(msg)
        if kind is not None:
            was.setdefault(name, kind)
    out = []
    for name, msgs in merged.items():
        musts = [m.removeprefix("must be ") for m in msgs if m.startswith("must be ")]
        rest = [m for m in msgs if not m.startswith("must be ")]
        said = [f"must be {', or '.join(musts) if any(' or ' in m for m in musts) else ' or '.join(musts)}"
                ] if musts else []
        text = " or ".join(said + rest)
        out.append((name, f"{text}, not {was[name]}" if name in was and not rest else text))
    return out
