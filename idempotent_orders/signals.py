"""Signals sent by idempotent_orders. All are sent after the transaction commits.

The ones sent for every message (``order_transitioned``, ``message_consumed``,
``dedup_answered``) cache their receivers per sender (Django's ``use_caching``;
connecting or disconnecting a receiver clears the cache), so a send does not
walk every receiver each time. Their senders are classes.
"""

from django.dispatch import Signal

#: Sent by apply_transition() after a transition commits.
#: Arguments: ``order``, ``transition`` (method name), ``source``, ``target``, ``version``.
order_transitioned = Signal(use_caching=True)

#: Sent by consume_message() for every message it decides, after commit (inside a
#: caller's transaction, when that commits; never for one rolled back). A copy the fast
#: path answers, settled by an earlier commit, is reported at once.
#: Arguments: ``consumer``, ``message_id``, ``message_type``, ``order_id`` (or None),
#: ``outcome`` (an Outcome), ``reason`` (str, empty unless parked/rejected/stale).
message_consumed = Signal(use_caching=True)

#: Sent when a parked message is released and decided again.
#: Arguments: ``consumer``, ``message_id``, ``order_id``, ``outcome``.
message_released = Signal()

#: Sent by relay_outbox() after a run that published or failed to publish rows.
#: Arguments: ``published``, ``retried`` (failed publishes, to be tried again), ``pending``,
#: ``dead`` (rows dead-lettered by this run).
outbox_relayed = Signal()
#: Sent when the relay dead-letters an outbox row (``OUTBOX_MAX_ATTEMPTS`` failed
#: publishes, or a ``PermanentPublishError``).
#: Arguments: ``message_id``, ``task_name``, ``attempts``, ``error`` (the last one).
outbox_dead = Signal()
#: Sent when ``@idempotent`` work is dead-lettered (``IDEMPOTENT_MAX_ATTEMPTS`` failed
#: runs, or a ``PermanentFailure``), once per dead row, after the failure is recorded.
#: Arguments: ``consumer``, ``message_id``, ``attempts``, ``error`` (the last one).
message_dead = Signal()
#: Sent for every dedup decision, saying which layer answered.
#: Arguments: ``layer`` (an ``idempotent_orders.dedup.Layer``: memory-hit, bloom-negative,
#: bloom-warming, redis-hit, redis-miss, redis-down, disabled, database-conflict),
#: ``consumer``, ``message_id``.
#: Sent synchronously in the consuming process (lookups happen before any transaction).
dedup_answered = Signal(use_caching=True)

#: Sent once per parked message that waited longer than ``PARKED_TIMEOUT`` and
#: was marked overdue. Arguments: ``parked`` (the ParkedMessage), ``waited`` (seconds).
parked_overdue = Signal()

#: Sent when leased work (see leases.py) ends an attempt.
#: Arguments: ``consumer``, ``message_id``, ``order_id`` (or None), ``result``
#: (a StepResult value: completed, retry, failed, skipped), ``via`` (worker,
#: reconciler or admin), ``stalls`` (expired claims before this one).
lease_finished = Signal()

#: Sent by the reconciler for every expired row it looked at.
#: Arguments: ``consumer``, ``message_id``, ``order_id``, ``action`` (completed,
#: retry, failed, skipped).
message_reconciled = Signal()

#: Sent by the idempotency decorator/mixins for every request that carries a key or token.
#: Arguments: ``request``, ``key``, ``outcome`` (``"executed"``, ``"replayed"``,
#: ``"redirected"`` (a form's second submit), ``"released"`` (5xx/exception/invalid form:
#: the key can be retried), ``"lease-lost"`` (the view ran and committed without
#: ``ATOMIC_REQUESTS`` after another request took its key over; nothing was stored)
#: or an error code such as ``"key-in-flight"``).
idempotent_request = Signal()
