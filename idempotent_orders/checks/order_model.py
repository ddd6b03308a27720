"""Checks of the order model: it exists, its state graph drives every message type, and
its setting did not change after the first migrate (E040-E045, W041); a payment
timeout names one of its transitions (E052); an order admin's operator transitions
each get an action (W046).
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from idempotent_orders.checks.configuration import well_typed

__all__ = [
    "check_operator_transitions",
    "check_order_model",
    "check_order_model_history",
    "check_payment_timeout",
]


@register(Tags.models)
def check_order_model(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The configured order model exists, has a usable state graph, and binds every message type."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders import get_order_model
    from idempotent_orders.conf import ORDER_MODEL_SETTING
    from idempotent_orders.consuming import registry
    from idempotent_orders.consuming.graph import edges, has_transition
    from idempotent_orders.consuming.running import parameters
    from idempotent_orders.exceptions import UnknownTransition
    from idempotent_orders.models import AbstractOrder
    from idempotent_orders.orders import missing_create_fields

    try:
        model = get_order_model()
    except ImproperlyConfigured as exc:
        return [
            Error(str(exc), hint="Set it before the first migrate.", id="idempotent_orders.E040")
        ]
    label = model._meta.label
    if not issubclass(model, AbstractOrder):
        return [
            Error(
                f"{ORDER_MODEL_SETTING} is {label}, which does not subclass "
                "idempotent_orders.models.AbstractOrder.",
                hint="AbstractOrder adds the version, last_seq and has_parked columns "
                "the consumer needs.",
                id="idempotent_orders.E041",
            )
        ]
    try:
        list(edges(model))
    except UnknownTransition as exc:
        return [Error(str(exc), obj=model, id="idempotent_orders.E042")]
    errors: list[CheckMessage] = []
    for handler in registry.registered():
        if not has_transition(model, handler.transition):
            errors.append(
                Error(
                    f"Message type {handler.message_type!r} drives {handler.transition!r}, "
                    f"which is not a transition of {label}.",
                    hint="Register the type with one of: "
                    + ", ".join(sorted(e.name for e in edges(model))),
                    obj=model,
                    id="idempotent_orders.E043",
                )
            )
    undrivable = []
    for handler in registry.registered():
        if not has_transition(model, handler.transition):
            continue
        accepted = parameters(model, handler.transition)
        unnamed = sorted(accepted.required - accepted.names)
        if unnamed:
            undrivable.append(
                f"{handler.message_type!r} -> {handler.transition}() "
                f"(positional-only: {', '.join(unnamed)})"
            )
    if undrivable:
        # Only what a message type is bound to is checked; all of it in one message.
        errors.append(
            Error(
                f"{label}: a message cannot call these transitions, whose methods take "
                f"parameters that cannot be passed by name: {'; '.join(undrivable)}.",
                hint="Give the parameters names (drop the '/'), or register the type with "
                "arguments= and a method that takes keyword arguments.",
                obj=model,
                id="idempotent_orders.E044",
            )
        )
    missing = missing_create_fields(model)
    if missing:
        errors.append(
            Warning(
                f"{label} lacks {', '.join(missing)}: create_order() and POST /api/orders/ "
                "answer with a configuration error.",
                hint="Create orders your own way, or add the fields.",
                obj=model,
                id="idempotent_orders.W041",
            )
        )
    return errors


@register(Tags.database)
def check_order_model_history(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The order model setting was not changed after this app's first migrate (E045).

    Runs where Django checks databases (``migrate`` does, before it would fail with
    an ``InconsistentMigrationHistory`` that does not say why).
    """
    from django.db import DatabaseError, connections
    from django.db.migrations.exceptions import InconsistentMigrationHistory
    from django.db.migrations.loader import MigrationLoader

    from idempotent_orders.conf import ORDER_MODEL_SETTING, order_model_label

    errors: list[CheckMessage] = []
    for alias in databases or ():
        try:
            loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
            loader.check_consistent_history(connections[alias])
        except InconsistentMigrationHistory as exc:
            if "idempotent_orders." not in str(exc):
                continue
            label = order_model_label()
            errors.append(
                Error(
                    f"Database {alias!r}: this app's migrations were applied before those of "
                    f"the order model {label} ({exc}). {ORDER_MODEL_SETTING} was set or changed "
                    "after the first migrate; the app's tables point at the old order table.",
                    hint=(
                        "Either set it back, or unapply this app's migrations and apply them "
                        "again (`manage.py migrate idempotent_orders zero`, then `migrate`: "
                        "the inbox, parked messages, outbox and keys are dropped, so do it "
                        "before going live, or copy them first). See "
                        "docs/own-order-model.md, 'Adopting an existing table'."
                    ),
                    id="idempotent_orders.E045",
                )
            )
        except DatabaseError:
            continue  # an unreachable database: migrate itself reports it
    return errors


@register(Tags.models)
def check_payment_timeout(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A payment timeout names a transition of the order model, and is not negative."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders import get_order_model
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming.graph import has_transition

    names = ("PAYMENT_TIMEOUT", "PAYMENT_TIMEOUT_TRANSITION")
    if not all(well_typed(n) for n in names) or conf.PAYMENT_TIMEOUT == 0:
        return []
    if conf.PAYMENT_TIMEOUT < 0:
        return [
            Error(
                "PAYMENT_TIMEOUT must be a number of seconds (0: orders never expire).",
                id="idempotent_orders.E052",
            )
        ]
    try:
        model = get_order_model()
    except ImproperlyConfigured:
        return []  # E040 says so
    if not has_transition(model, conf.PAYMENT_TIMEOUT_TRANSITION):
        return [
            Error(
                f"PAYMENT_TIMEOUT is set, but the order model {model._meta.label} has no "
                f"transition {conf.PAYMENT_TIMEOUT_TRANSITION!r} (PAYMENT_TIMEOUT_TRANSITION) "
                "for its timers to take.",
                hint="Name one of its @transition methods, or set PAYMENT_TIMEOUT to 0.",
                id="idempotent_orders.E052",
            )
        ]
    return []


@register(Tags.admin)
def check_operator_transitions(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every ``operator_transitions`` entry of an order admin gets its action (W046): it
    names a transition of the admin's model, and one with a target (a targetless
    transition moves no state: the admin offers no action for it)."""
    from django.contrib import admin

    from idempotent_orders.admin.orders import OrderAdminMixin
    from idempotent_orders.consuming.graph import edge, has_transition
    from idempotent_orders.exceptions import UnknownTransition

    found: list[CheckMessage] = []
    for model, model_admin in admin.site._registry.items():
        if not isinstance(model_admin, OrderAdminMixin):
            continue
        for name in model_admin.operator_transitions:
            try:
                if not has_transition(model, name):
                    why = "is not a transition of the model"
                elif edge(model, name).targetless:
                    why = "has no target (target=None): it moves no state"
                else:
                    continue
            except UnknownTransition:
                continue  # E042 says why the graph cannot be read
            found.append(
                Warning(
                    f"{type(model_admin).__name__}.operator_transitions names {name!r}, "
                    f"which {why}; the admin offers no action for it.",
                    hint="Name a transition of the model with a target, or remove the entry.",
                    obj=model_admin,
                    id="idempotent_orders.W046",
                )
            )
    return found
