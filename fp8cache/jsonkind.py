"""What a parsed JSON value is, in JSON's words, for error messages: whoever wrote it wrote JSON, not Python
("an array", not "list"; "null", not "NoneType")."""

from __future__ import annotations

from typing import Any


def json_kind(value: Any) -> str:
    """'null', 'true (a boolean)', 'a number', 'a string', 'an array' or 'an object'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    return "an object" if isinstance(value, dict) else "another value"
