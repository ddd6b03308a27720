"""Webhook ingress: verify a provider's signature, store the raw event, consume it once.

A project includes ``idempotent_orders.webhooks.urls`` (e.g. under ``webhooks/``)
and names its providers in ``IDEMPOTENT_ORDERS["WEBHOOKS"]``; see
``docs/webhooks-and-timers.md``. The event id is the message id, so the inbox
decides, as for any message, that an event takes effect once.
"""
