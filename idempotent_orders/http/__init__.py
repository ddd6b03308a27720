"""HTTP idempotency: the ``Idempotency-Key`` header, one-time tokens, forms and the orders API."""

from idempotent_orders.http.decorators import IdempotentMixin, idempotent_view
from idempotent_orders.http.forms import IdempotentFormMixin, idempotent_form

__all__ = ["IdempotentFormMixin", "IdempotentMixin", "idempotent_form", "idempotent_view"]
