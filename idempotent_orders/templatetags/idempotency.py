"""``{% load idempotency %}{% idempotency_token %}``: the hidden one-time token field."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString

from idempotent_orders.http.forms import hidden_field
from idempotent_orders.http.tokens import get_token

register = template.Library()


@register.simple_tag(takes_context=True)
def idempotency_token(context: dict[str, Any]) -> SafeString:
    """Render ``<input type="hidden" name="idempotency_token" value="...">``.

    Needs ``request`` in the context (the ``request`` context processor).
    """
    request = context.get("request")
    if request is None:
        raise template.TemplateSyntaxError(
            "{% idempotency_token %} needs the request context processor"
        )
    return hidden_field(get_token(request))
