"""Griffe extension: Sphinx roles in docstrings (:func:`x`, :class:`~a.B`) shown as code.

The code's docstrings use reST cross-reference roles; MkDocs would print the role
name literally. The target becomes inline code (``~`` keeps the last component,
as Sphinx does), without changing the source.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
