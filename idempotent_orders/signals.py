"""Signals sent by idempotent_orders. All are sent after the transaction commits."""

from django.dispatch import Signal

#: Sent by apply_transition() after a transition commits.
#: Arguments: ``order``, ``transition`` (method name), ``source``, ``target``, ``version``.
order_transitioned = Signal()

#: Sent by consume_message() for every message it decides, after commit.
#: Arguments: ``consumer``, ``message_id``, ``message_type``, ``order_id`` (or None),
#: ``outcome`` (an Outcome), ``reason`` (str, empty unless parked/rejected/stale).
message_consumed = Signal()

#: Sent when a parked message is released and decided again.
#: Arguments: ``consumer``, ``message_id``, ``order_id``, ``outcome``.
message_released = Signal()

#: Sent by the idempotency decorator/mixins for every request that carries a key or token.
#: Arguments: ``request``, ``key``, ``outcome`` (``"executed"``, ``"replayed"``,
#: ``"redirected"`` (a form's second submit), ``"released"`` (5xx/exception/invalid form:
#: the key can be retried) or an error code such as ``"key-in-flight"``).
idempotent_request = Signal()
