"""PostgreSQL array literals for the batch statements (``unnest(%s::<type>[])``)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

__all__ = ["array_literal"]


def array_literal(values: list[Any]) -> Any:
    """``values`` as one PostgreSQL array literal (text), or the list itself.

    psycopg adapts a list element by element in Python; for the types written
    here (text, integers, aware datetimes, finite decimals, NULL) the literal is
    built in one pass. Any other type is left to psycopg.
    """
    kinds = set(map(type, values))
    if kinds == {str}:
        text = '","'.join(values)
        if "\\" not in text and text.count('"') == 2 * (len(values) - 1):
            return '{"' + text + '"}'  # nothing to escape: the usual case, built in C
    elif kinds == {int}:
        return "{" + ",".join(map(str, values)) + "}"
    parts: list[str] = []
    append = parts.append
    for value in values:
        kind = type(value)
        if value is None:
            append("NULL")
        elif kind is int:
            append(str(value))
        elif kind is str:
            append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif kind is datetime and value.tzinfo is not None:
            append('"' + value.isoformat() + '"')
        elif kind is Decimal and value.is_finite():
            append(str(value))
        else:
            return values
    return "{" + ",".join(parts) + "}"
