"""``{% load idempotent_orders_admin %}{% attention_dashboard %}``: the app index's dashboard."""

from __future__ import annotations

from typing import Any

from django import template

from idempotent_orders.admin import attention

register = template.Library()


@register.inclusion_tag("admin/idempotent_orders/attention.html", takes_context=True)
def attention_dashboard(context: dict[str, Any]) -> dict[str, Any]:
    """Counts of what needs an operator, each linking to its filtered changelist."""
    return {"lines": attention(context["request"].user)}
