"""HTTP idempotency: the ``Idempotency-Key`` header, one-time tokens, forms and the orders API."""
