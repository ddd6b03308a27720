"""Registry of message types: each names the order model's transition it drives.

A project registers its types with :func:`register` from its ``AppConfig.ready()``.
The built-in payment, shipping and fulfilment types are registered in this
app's ``ready()`` for each of them whose transition the order model declares
(all of them on the default ``Order``), unless the project registered that
type itself. A type bound to a transition the model does not have is a system
check error (``idempotent_orders.E040``), never a per-message crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db.models import Model

from idempotent_orders.consuming import rules
from idempotent_orders.consuming.rules import Rule

#: Turns (order, payload) into the extra columns the transition writes; raises InvalidMessage.
#: The order is an instance of the order model (typed loosely so validators may name their own).
Validator = Callable[[Any, Mapping[str, Any]], dict[str, Any]]
#: Turns (order, payload) into the keyword arguments the transition method is called with.
Arguments = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class MessageHandler:
    message_type: str
    #: Name of an ``@transition`` method on the order model.
    transition: str
    validate: Validator
    #: Consumers allowed to receive this type; empty means any.
    consumers: frozenset[str] = frozenset()
    #: Shapes the transition method's keyword arguments; None: the payload entries
    #: whose names the method takes as parameters (all of them for ``**kwargs``).
    arguments: Arguments | None = None
    #: The message carries money (a payment): when it cannot apply, it is kept as
    #: rejected and said to be money to give back, never counted stale.
    money: bool = False
    #: The payload key that names the payment a money message spends (recorded once:
    #: the same payment under a new message id is never applied twice).
    payment_key: str = "payment_id"


_registry: dict[str, MessageHandler] = {}

#: The built-in types that carry money: money messages unless registered with ``money=False``.
MONEY = frozenset({"payment.succeeded"})


def register(
    message_type: str,
    *,
    transition: str,
    validate: Validator | None = None,
    consumers: frozenset[str] | set[str] | None = None,
    arguments: Arguments | None = None,
    money: bool | None = None,
    payment_key: str | None = None,
) -> None:
    """Make ``message_type`` drive the order model's ``transition``.

    A message of the type calls the model's own ``@transition`` method, as
    django-fsm-2 would: with the payload entries whose names are parameters of
    the method as keyword arguments (every entry when it takes ``**kwargs``),
    or with what ``arguments(order, payload)`` returns when given. ``money``
    marks a type that carries a payment: one that can never apply to its order is
    rejected as money to give back, and the payment its payload names under
    ``payment_key`` (``"payment_id"`` by default) is spent once. Left out, both keep
    what the type had: registering ``payment.succeeded`` again with another
    transition or validator keeps it a money message.

    ``validate(order, payload)`` returns the columns the transition writes
    besides the state (``{}`` for none) or raises
    :class:`~idempotent_orders.exceptions.InvalidMessage` with a reason.
    ``consumers`` restricts which consumers accept the type (others reject it).
    Registering a type again replaces it, but for ``money`` and ``payment_key`` when
    they are left out.
    """
    before = _registry.get(message_type)
    if money is None:
        money = before.money if before is not None else message_type in MONEY
    if payment_key is None:
        payment_key = before.payment_key if before is not None else "payment_id"
    _registry[message_type] = MessageHandler(
        message_type=message_type,
        transition=transition,
        validate=validate or _no_payload,
        consumers=frozenset(consumers or ()),
        arguments=arguments,
        money=money,
        payment_key=payment_key,
    )


def get_handler(message_type: str) -> MessageHandler | None:
    return _registry.get(message_type)


def registered() -> list[MessageHandler]:
    """Every registered message type, sorted by name."""
    return [_registry[name] for name in sorted(_registry)]


#: The built-in validators, each a :class:`~idempotent_orders.consuming.rules.Rule`: a
#: project registering its own type may name them (``validate=registry.validate_payment``).
validate_payment: Rule = rules.PAYMENT
validate_refund: Rule = rules.REFUND
validate_shipment: Rule = rules.SHIPMENT
validate_delivery: Rule = rules.DELIVERY
_no_payload: Rule = rules.NOTHING


#: The built-in types: (type, transition, validator, consumers).
BUILT_IN: list[tuple[str, str, Validator, frozenset[str]]] = [
    ("payment.succeeded", "pay", validate_payment, frozenset()),
    ("payment.refunded", "refund", validate_refund, frozenset()),
    ("shipment.dispatched", "ship", validate_shipment, frozenset()),
    ("shipment.delivered", "complete", validate_delivery, frozenset()),
    ("order.cancelled", "cancel", _no_payload, frozenset()),
    # Internal: the fulfilment step without a warehouse call. The leased path
    # (idempotent_orders.fulfilment.fulfil) records the same inbox row; an
    # outside producer cannot send this type to the payment or shipping consumers.
    ("order.fulfilment", "start_processing", _no_payload, frozenset({"fulfilment"})),
]


def register_built_in(model: type[Model]) -> list[str]:
    """Register each built-in type whose transition ``model`` declares and the project did not
    register itself; return the types registered. Called from the app's ``ready()``.
    """
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming.graph import has_transition

    done = []
    for message_type, transition, validate, consumers in BUILT_IN:
        if message_type == "order.fulfilment":
            transition = conf.FULFILMENT_TRANSITION
        if message_type in _registry or not has_transition(model, transition):
            continue
        register(
            message_type,
            transition=transition,
            validate=validate,
            consumers=consumers,
        )
        done.append(message_type)
    return done
