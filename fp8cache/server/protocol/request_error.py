"""RequestError, the one exception a refused request becomes, and the translation of pydantic's failures
into it. The HTTP answer it turns into (OpenAI's or TGI's error shape) is made in server/errors.py."""

from __future__ import annotations

from pydantic import ValidationError


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


def _loc_name(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and part.startswith("function-")))


def validation_error(exc: ValidationError, status: int = 400) -> RequestError:
    """One RequestError for a pydantic failure; names the first bad field and lists the others."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p not in ("str", "list[any]", "int", "float", "bool"))
        name = _loc_name(loc) or "body"
        if err["type"] == "extra_forbidden":
            problems.append((name, "unknown field; remove it"))
        elif err["type"] == "missing":
            problems.append((name, "is required"))
        else:
            msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
            problems.append((name, msg))
    problems = _merge_same_field(problems)
    first = problems[0][0] if problems else None
    message = "; ".join(f"{name}: {msg}" for name, msg in problems[:5])
    if len(problems) > 5:
        message += f"; and {len(problems) - 5} more problems"
    return RequestError(message, status=status, param=first, code="invalid_value")


def _merge_same_field(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # A union field reports one failure per member ("valid string", "valid list"): say them as one.
    merged: dict[str, list[str]] = {}
    for name, msg in problems:
        if msg not in merged.setdefault(name, []):
            merged[name].append(msg)
    return [(name, " or ".join(msgs)) for name, msgs in merged.items()]
