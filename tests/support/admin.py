"""Reading the Django admin's pages in tests: messages shown, a change form as posted back."""

from __future__ import annotations

from typing import Any


def shown(response: Any) -> list[str]:
    """The admin messages a response carries, as the operator reads them."""
    return [str(m) for m in response.context["messages"]]


def form_data(page: Any) -> dict[str, Any]:
    """What a browser posts back for the change form as rendered (unchanged)."""
    form = page.context["adminform"].form
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form[name].value()
        data[name] = "" if value is None else value
    return data
