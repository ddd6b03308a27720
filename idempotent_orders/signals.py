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

#: Sent when leased work (see leases.py) ends an attempt.
#: Arguments: ``consumer``, ``message_id``, ``order_id`` (or None), ``result``
#: (a StepResult value: completed, retry, failed, skipped), ``via`` (worker,
#: reconciler or admin), ``stalls`` (expired claims before this one).
lease_finished = Signal()

#: Sent by the reconciler for every expired row it looked at.
#: Arguments: ``consumer``, ``message_id``, ``order_id``, ``action`` (completed,
#: retry, failed, skipped).
message_reconciled = Signal()
