"""Django admin for orders, the inbox, parked messages, the outbox and keys.

The order admin is :class:`OrderAdminMixin` on a ``ModelAdmin``. Like
``UserAdmin`` for ``auth.User``, :class:`OrderAdmin` is registered only when the
order model is the default ``idempotent_orders.Order``; a project with its own
(``IDEMPOTENT_ORDERS_ORDER_MODEL``) registers its model with the mixin. The
mixin reads everything from the model: its state field, its transitions, the
columns it has.

The admin cannot break the guarantee the workers keep:

- **The order form** carries the version it was opened at (a hidden field). A
  save is one conditional ``UPDATE ... WHERE version = <that version>`` that
  bumps ``version``; a stale save changes nothing and names the fields that
  changed. What messages own (the state field, ``version``, ``last_seq``,
  ``has_parked`` and the columns of ``message_owned_fields``: ``payment_id``,
  ``tracking_number``, ``carrier`` where they exist) is read-only, so is
  ``business_key`` once the order exists, and ``amount``/``currency`` too once
  the order left its initial state (a payment was checked against them).
- **Evidence is never added or deleted**: inbox (``ProcessedMessage``), parked,
  outbox and ``IdempotencyKey`` rows (deleting an inbox row would let its
  message take effect again); retention is the purge commands' job. Inbox,
  parked and key rows are view-only too: saving their form would write back
  every column as it was read.
  An order a message refers to cannot be deleted either (its inbox rows would
  lose their order and its parked messages would go with it); an order no
  message touched (created by mistake) can.
- **Transition actions** (one per declared transition with a target state, labelled "Mark as
  shipped") show a confirmation page listing every selected order, its state
  and what will happen; they honour the transition's fsm-2 ``permission=`` and
  ``conditions=``, report per order in words, and are audited. Rules:

  - ``cancel``, ``expire`` (the mixin's ``operator_transitions``): the
    operator's decision (no money moved yet, no effect outside the database);
  - ``start_processing`` (the fulfilment step's transition,
    :func:`~idempotent_orders.fulfilment.transition`): only through the leased fulfilment step
    (:func:`~idempotent_orders.fulfilment.fulfil`), which asks the warehouse
    once with the step's idempotency key; an unpaid order is refused without
    touching the inbox;
  - ``pay``, ``ship``, ``complete``, ``refund`` (any transition a message type
    drives): only to apply a message of that type the inbox refused for the
    order (a ``rejected``/``failed`` row) whose payload validates now (e.g. the
    amount was corrected); the payment id, tracking number, ... come from that
    message and the audit entry names it. Without one the action refuses: only
    the payment provider or the warehouse can say it happened.

- **The app index** shows what needs an operator (:func:`attention`): stuck and
  failed leased work, rejections today, overdue parked messages, the pending
  outbox, each count linking to the list of exactly those rows.

Every action goes through the same services as the workers
(:func:`~idempotent_orders.consuming.running.apply_transition`, the reconciler's
functions), is idempotent (a second click finds nothing to do) and is recorded
as an :class:`~idempotent_orders.models.AuditEntry`.

The package, one concept per module (this module imports them all, so Django's
autodiscovery of ``idempotent_orders.admin`` registers every ``ModelAdmin`` once):

- :mod:`~idempotent_orders.admin.orders`: :class:`OrderAdminMixin`, :class:`OrderAdmin`,
  :class:`OrderChangeForm` (the version-carrying form), the timeline on the change page;
- :mod:`~idempotent_orders.admin.order_actions`: the "Mark as ..." actions and their rules;
- :mod:`~idempotent_orders.admin.inbox`: the inbox (``ProcessedMessage``) and its row actions;
- :mod:`~idempotent_orders.admin.evidence`: parked messages and the audit trail;
- :mod:`~idempotent_orders.admin.outbox`: the outbox;
- :mod:`~idempotent_orders.admin.keys`: idempotency keys;
- :mod:`~idempotent_orders.admin.dashboard`: what needs attention, liveness lines, the
  filters its counts link to;
- :mod:`~idempotent_orders.admin.common`: what they share (the audit, key search, the
  evidence base classes, "requeue dead rows").
"""

from __future__ import annotations

from idempotent_orders.admin.common import (
    ConsumerFilter,
    EvidenceAdmin,
    KeySearchMixin,
    ReadOnlyEvidenceAdmin,
    audit,
)
from idempotent_orders.admin.dashboard import (
    Attention,
    AttentionFilter,
    ParkedAttentionFilter,
    attention,
    left_to_do,
)
from idempotent_orders.admin.evidence import (
    AuditEntryAdmin,
    AuditTargetFilter,
    ParkedMessageAdmin,
)
from idempotent_orders.admin.inbox import MessageTypeFilter, ProcessedMessageAdmin, RowPlan
from idempotent_orders.admin.keys import IdempotencyKeyAdmin
from idempotent_orders.admin.order_actions import Plan, Rule, action_label, plan, transition_rule
from idempotent_orders.admin.orders import (
    MACHINERY_FIELDS,
    MESSAGE_COLUMNS,
    OrderAdmin,
    OrderAdminMixin,
    OrderChangeForm,
    StaleOrder,
)
from idempotent_orders.admin.outbox import OutboxMessageAdmin

__all__ = [
    "MACHINERY_FIELDS",
    "MESSAGE_COLUMNS",
    "Attention",
    "AttentionFilter",
    "AuditEntryAdmin",
    "AuditTargetFilter",
    "ConsumerFilter",
    "EvidenceAdmin",
    "IdempotencyKeyAdmin",
    "KeySearchMixin",
    "MessageTypeFilter",
    "OrderAdmin",
    "OrderAdminMixin",
    "OrderChangeForm",
    "OutboxMessageAdmin",
    "ParkedAttentionFilter",
    "ParkedMessageAdmin",
    "Plan",
    "ProcessedMessageAdmin",
    "ReadOnlyEvidenceAdmin",
    "RowPlan",
    "Rule",
    "StaleOrder",
    "action_label",
    "attention",
    "audit",
    "left_to_do",
    "plan",
    "transition_rule",
]
