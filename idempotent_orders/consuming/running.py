"""Running a transition: the model's own fsm-2 method, then its commit.

:func:`call_transition` calls the ``@transition`` method as django-fsm-2 does
(conditions, body, signals with the arguments, ``on_error``, ``RETURN_VALUE`` /
``GET_STATE``) and collects what it changed; :func:`commit` writes it: through the
model's own ``save()`` where anything of the project's runs on it
(:func:`save_hooks`), with the condition added to the UPDATE it sends, and otherwise
with one ``UPDATE ... WHERE pk AND state AND version``. :func:`apply_transition` does both
for one order (the admin, the fulfilment step); the consumers call the two steps
inside the transaction that claimed the message. Follow-ups (work a transition
queues in its own transaction, such as the fulfilment outbox row) are registered here.
"""

from __future__ import annotations

import contextlib
import copy
import dis
import inspect
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, Protocol

from django.db import transaction
from django.db.models import F, Field, Model
from django.db.models.options import Options
from django.db.models.signals import post_save, pre_save
from django.utils import timezone
from django_fsm.signals import post_transition, pre_transition

from idempotent_orders.consuming.graph import (
    TransitionResult,
    TransitionStatus,
    check_transition,
    current_state,
    edge,
    state_field,
)
from idempotent_orders.exceptions import OrderChanged, TransactionAborted, TransitionNotSaved
from idempotent_orders.models import SAVE_GUARD, SAVE_HOLD
from idempotent_orders.signals import order_transitioned
from idempotent_orders.vendors import vendor


def written_values(model: type[Model], fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """The columns a transition writes besides state and version: ``fields``, and
    ``updated_at`` when the model has one (a queryset UPDATE skips ``auto_now``).
    """
    values: dict[str, Any] = dict(fields or {})
    if _has_updated_at(model):
        values.setdefault("updated_at", timezone.now())
    return values


@cache
def _has_updated_at(model: type[Model]) -> bool:
    return any(f.name == "updated_at" for f in model._meta.concrete_fields)


def advance(
    instance: Model, name: str, values: Mapping[str, Any] | None = None
) -> TransitionResult:
    """Move ``instance`` along transition ``name`` in memory: state, ``version + 1``, ``values``.

    No database write and no check: the caller decided with
    :func:`check_transition` and commits the row with a conditional UPDATE
    (:func:`apply_transition` for one order; the batch consumer for many).
    """
    model = type(instance)
    field = state_field(model)
    e = edge(model, name)
    source = current_state(instance)
    field.set_state(instance, e.target)
    version = instance.version + 1  # type: ignore[attr-defined]
    instance.version = version  # type: ignore[attr-defined]
    for key, value in (values or {}).items():
        setattr(instance, key, value)
    return TransitionResult(TransitionStatus.APPLIED, source, e.target, version)


def transition_starting(instance: Model, name: str) -> None:
    """Send fsm-2's ``pre_transition`` for ``name`` from the state ``instance`` is in.

    Sent before the conditional UPDATE; a receiver that raises aborts the write.
    """
    if not pre_transition.has_listeners(type(instance)):
        return
    source = current_state(instance)
    pre_transition.send(**_fsm_signal(instance, name, source, edge(type(instance), name).target))


class FollowUp(Protocol):
    """Work a transition queues in its own transaction (an outbox row, for instance)."""

    def wanted(self, model: type[Model], target: Any) -> bool:
        """Whether entering ``target`` on ``model`` queues this follow-up."""

    def write(self, instance: Model, name: str, result: TransitionResult) -> None:
        """Queue it, in the transaction that committed the transition."""

    # Optional: ``write_many(written)``, with ``written`` a list of ``(instance, name,
    # result)`` of one transaction (a batch chunk's), queues it for each of them at
    # once (one multi-row INSERT, say); a follow-up without it is written one by one.
    #
    # Optional: ``outbox_row(model, pk, name, target)`` returns the outbox row
    # :meth:`write` would write for order ``pk`` as a :class:`FollowUpRow` (or None),
    # with no side effect, so that a road may write it in its own statement
    # (PostgreSQL's one-statement road); without it, :meth:`write` is called.


@dataclass(frozen=True)
class FollowUpRow:
    """The outbox row a follow-up would write for one transition, handed over as data."""

    #: The row's ``OutboxMessage`` fields by name: ``message_id``, ``task_name``,
    #: ``payload``, ``options``, ``order_key``, ``traceparent``, ``correlation_id``.
    fields: Mapping[str, Any]
    #: Called with ``(database, row id)`` once the road wrote the row, before its commit
    #: (it schedules the publish after commit). Not called when the message id was in
    #: the outbox already: that row is the message, as for ``publish_on_commit``.
    written: Callable[[str, int], None]


_follow_ups: list[FollowUp] = []


def register_follow_up(follow_up: FollowUp) -> None:
    """Run ``follow_up`` in the transaction of every transition it wants (idempotent)."""
    if follow_up not in _follow_ups:
        _follow_ups.append(follow_up)


def follow_up_rows(
    model: type[Model], pk: Any, name: str, target: Any
) -> list[tuple[FollowUp, FollowUpRow]] | None:
    """The outbox rows of the follow-ups a transition into ``target`` wants, as data;
    None when one of them does not hand its row over (it is written by ``write``)."""
    rows = []
    for follow_up in _follow_ups:
        if not follow_up.wanted(model, target):
            continue
        hook = getattr(follow_up, "outbox_row", None)
        row = hook(model, pk, name, target) if hook is not None else None
        if row is None:
            return None
        rows.append((follow_up, row))
    return rows


def in_transaction_work(model: type[Model], target: Any) -> bool:
    """Whether a transition into ``target`` has work to do inside its transaction:
    a follow-up, or a receiver of fsm-2's ``pre_transition``/``post_transition``.
    """
    return (
        any(f.wanted(model, target) for f in _follow_ups)
        or pre_transition.has_listeners(model)
        or post_transition.has_listeners(model)
    )


def transition_heard(model: type[Model], target: Any) -> bool:
    """Whether announcing a transition into ``target`` reaches anyone: work inside
    its transaction (:func:`in_transaction_work`) or a receiver of
    :data:`~idempotent_orders.signals.order_transitioned`. The consuming paths
    skip :func:`transition_written` (and building what it is handed) otherwise.
    """
    return in_transaction_work(model, target) or order_transitioned.has_listeners(model)


def transition_written(
    instance: Model,
    name: str,
    result: TransitionResult,
    *,
    fsm_sent: bool = False,
    handed: Collection[FollowUp] = (),
) -> None:
    """Announce a transition whose UPDATE succeeded: fsm-2's ``post_transition`` (unless the
    model's own method already sent it: ``fsm_sent``) and the follow-ups now, in the
    transaction (they may write in it), and
    :data:`~idempotent_orders.signals.order_transitioned` after commit. ``handed``: the
    follow-ups whose row the caller wrote itself (:func:`follow_up_rows`).
    """
    model = type(instance)
    if not fsm_sent and post_transition.has_listeners(model):
        post_transition.send(**_fsm_signal(instance, name, result.source, result.target))
    for follow_up in _follow_ups:
        if follow_up not in handed and follow_up.wanted(model, result.target):
            follow_up.write(instance, name, result)
    _announce_after_commit(instance, name, result)


def transitions_written(
    written: Sequence[tuple[Model, str, TransitionResult]], *, fsm_sent: bool = False
) -> None:
    """:func:`transition_written` for the transitions of one transaction (a batch chunk's).

    Each follow-up that has ``write_many`` is handed every transition it wants at
    once; the others are written one by one, in the order given. fsm-2's
    ``post_transition`` (unless the model's own methods sent it: ``fsm_sent``) and
    :data:`~idempotent_orders.signals.order_transitioned` are sent for each, as
    :func:`transition_written` sends them.
    """
    if not written:
        return
    for instance, name, result in written:
        if not fsm_sent and post_transition.has_listeners(type(instance)):
            post_transition.send(**_fsm_signal(instance, name, result.source, result.target))
    for follow_up in _follow_ups:
        wants: dict[tuple[type[Model], Any], bool] = {}
        wanted = []
        for entry in written:
            key = (type(entry[0]), entry[2].target)
            if key not in wants:
                wants[key] = follow_up.wanted(*key)
            if wants[key]:
                wanted.append(entry)
        if not wanted:
            continue
        write_many = getattr(follow_up, "write_many", None)
        if write_many is not None:
            write_many(wanted)
        else:
            for entry in wanted:
                follow_up.write(*entry)
    # One after-commit callback for them all (per database), sending in the order given.
    by_db: dict[str | None, list[tuple[Model, str, TransitionResult]]] = {}
    for entry in written:
        by_db.setdefault(entry[0]._state.db, []).append(entry)
    for db, entries in by_db.items():
        transaction.on_commit(partial(_announce, entries), using=db)


def _announce_after_commit(instance: Model, name: str, result: TransitionResult) -> None:
    model = type(instance)
    transaction.on_commit(
        lambda: order_transitioned.send(
            sender=model,
            order=instance,
            transition=name,
            source=result.source,
            target=result.target,
            version=result.version,
        ),
        using=instance._state.db,
    )


def _announce(written: Sequence[tuple[Model, str, TransitionResult]]) -> None:
    """After commit: :data:`~idempotent_orders.signals.order_transitioned` for each."""
    for instance, name, result in written:
        order_transitioned.send(
            sender=type(instance),
            order=instance,
            transition=name,
            source=result.source,
            target=result.target,
            version=result.version,
        )


def _fsm_signal(instance: Model, name: str, source: Any, target: Any) -> dict[str, Any]:
    return {
        "sender": type(instance),
        "instance": instance,
        "name": name,
        "field": state_field(type(instance)),
        "source": source,
        "target": target,
        "method_args": (),
        "method_kwargs": {},
    }


# -- Running the model's own transition ---------------------------------------------------


def _returns_none_only(func: Any) -> bool:
    """Whether ``func``'s body does nothing: ``pass``, a docstring, ``...``, ``return None``."""
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    ops = [
        (i.opname, i.argval)
        for i in dis.get_instructions(code)
        if i.opname not in ("RESUME", "NOP", "CACHE")
    ]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


@cache
def has_body(model: type[Model], name: str) -> bool:
    """Whether transition ``name`` does more than move the state: a body that is not empty,
    a target its body decides (``RETURN_VALUE``, ``GET_STATE``), no target, or ``on_error``.
    """
    e = edge(model, name)
    if e.dynamic or e.targetless:
        return True
    declared = getattr(model, name)._django_fsm.transitions.values()
    return any(t.on_error is not None or not _returns_none_only(t.method) for t in declared)


def runs_user_code(model: type[Model], name: str) -> bool:
    """Whether committing ``name`` must call the model's method: it has a body
    (:func:`has_body`), someone receives fsm-2's ``pre_transition``/``post_transition``,
    or the model's ``save()`` runs something of the project's (:func:`save_hooks`).
    A transition for which this is false may be committed by one SQL statement.
    """
    # The kept answers first: a signal's receivers are looked up on every call.
    return (
        has_body(model, name)
        or bool(save_hooks(model))
        or pre_transition.has_listeners(model)
        or post_transition.has_listeners(model)
    )


def _own(receiver: Any) -> bool:
    """Whether ``receiver`` is one of this app's (they only count and watch)."""
    module = getattr(receiver, "__module__", "") or ""
    return module == "idempotent_orders" or module.startswith("idempotent_orders.")


def _receivers(signal: Any, model: type[Model]) -> list[Any]:
    """The receivers ``signal`` would call for ``model`` (any sender's included)."""
    live = signal._live_receivers(model)
    if isinstance(live, tuple):  # Django 5+: (sync receivers, async receivers)
        return [*live[0], *live[1]]
    return list(live)


def _describe(receiver: Any) -> str:
    owner = getattr(receiver, "__self__", None)
    if owner is not None:
        kind = type(owner)
        return f"{kind.__module__}.{kind.__qualname__}.{receiver.__name__}"
    name = getattr(receiver, "__qualname__", None) or repr(receiver)
    return f"{getattr(receiver, '__module__', '?')}.{name}"


_save_hooks: dict[type[Model], tuple[tuple[Any, ...], tuple[str, ...]]] = {}


def save_hooks(model: type[Model]) -> tuple[str, ...]:
    """What of the project's would run if an order of ``model`` were saved: a ``save()``
    override, receivers of ``pre_save``/``post_save`` for it (history and audit packages
    connect theirs there), database triggers that django-pgtrigger declares on it.
    Empty: nothing would run, and a transition may be committed by the app's own SQL.

    Each entry says what it is, for ``manage.py idempotent_orders_explain`` and the
    system check. Read from the model and the signals as they are now (receivers
    connected later are seen: the answer is kept until a receiver is connected or
    disconnected).
    """
    key = (len(pre_save.receivers), len(post_save.receivers), model.save)
    cached = _save_hooks.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    found: list[str] = []
    for klass in model.__mro__:
        if "save" in vars(klass):
            if klass is not Model:
                found.append(f"save() override in {klass.__module__}.{klass.__qualname__}")
            break
    for signal, label in ((pre_save, "pre_save"), (post_save, "post_save")):
        for receiver in _receivers(signal, model):
            if not _own(receiver):
                found.append(f"{label} receiver {_describe(receiver)}")
    for trigger in triggers(model):
        found.append(f"database trigger {getattr(trigger, 'name', trigger)} (pgtrigger)")
    hooks = tuple(found)
    _save_hooks[model] = (key, hooks)
    return hooks


def triggers(model: type[Model]) -> tuple[Any, ...]:
    """The database triggers django-pgtrigger declares on ``model`` (django-pghistory's)."""
    return tuple(getattr(model._meta, "triggers", None) or ())


def keeps_parked_flag(model: type[Model]) -> bool:
    """Whether the app keeps its ``has_parked`` flag on orders of ``model``.

    Not where database triggers watch the order's rows (:func:`triggers`): there the
    app's bookkeeping would show up as a change of its own in the project's trail.
    (``save()``, its receivers and history packages never see the flag: it is written
    by a queryset UPDATE.) The flag only lets a consumer skip its look for parked
    successors; without it every message looks (one query), and parking writes nothing
    on the order.
    """
    return not triggers(model)


def road(model: type[Model], name: str) -> tuple[str, str]:
    """The road a message driving transition ``name`` takes on ``model``, and why:
    ``("save", reasons)`` when the model's ``save()`` commits it, ``("transition",
    reasons)`` when the model's method runs and the app's conditional UPDATE commits
    it, ``("raw", reason)`` when one of the app's statements does it all."""
    hooks = save_hooks(model)
    if hooks:
        return "save", "; ".join(hooks)
    why = []
    if has_body(model, name):
        why.append(f"{model.__name__}.{name}() has a body")
    for signal, label in ((pre_transition, "pre_transition"), (post_transition, "post_transition")):
        why += [f"{label} receiver {_describe(r)}" for r in _receivers(signal, model)]
    if why:
        return "transition", "; ".join(why)
    return "raw", "nothing of the project's runs: no body, no receiver, no save() override"


@dataclass(frozen=True)
class Parameters:
    """The keyword parameters of a transition method (``self`` left out)."""

    names: frozenset[str]
    required: frozenset[str]
    #: The method takes ``**kwargs``: every payload entry is passed.
    any: bool


@cache
def parameters(model: type[Model], name: str) -> Parameters:
    """What transition ``name``'s method accepts as keyword arguments."""
    declared = next(iter(getattr(model, name)._django_fsm.transitions.values()))
    signature = inspect.signature(declared.method)
    names: set[str] = set()
    required: set[str] = set()
    takes_any = False
    for position, p in enumerate(signature.parameters.values()):
        if position == 0 and p.kind is not p.KEYWORD_ONLY:
            continue  # self
        if p.kind is p.VAR_KEYWORD:
            takes_any = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            required.add(p.name)  # never passed by name: the check names it
    return Parameters(frozenset(names), frozenset(required), takes_any)


def arguments(model: type[Model], name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments a message with ``payload`` calls transition ``name`` with:
    the payload entries the method names as parameters (all of them for ``**kwargs``).
    """
    accepted = parameters(model, name)
    if accepted.any:
        return {str(k): v for k, v in payload.items()}
    return {k: v for k, v in payload.items() if k in accepted.names}


def missing_arguments(model: type[Model], name: str, kwargs: Mapping[str, Any]) -> list[str]:
    """The required parameters of transition ``name`` that ``kwargs`` does not carry."""
    return sorted(parameters(model, name).required - set(kwargs))


class _Saves(threading.local):
    watched: dict[int, bool]

    def __init__(self) -> None:
        self.watched = {}


_saves = _Saves()


def _note_save(sender: Any, instance: Model, **kwargs: Any) -> None:
    watched = _saves.watched
    if watched and id(instance) in watched:
        watched[id(instance)] = True


post_save.connect(_note_save, dispatch_uid="idempotent_orders.consuming.running.note_save")


@dataclass
class Ran:
    """What calling the model's transition method did to the instance, in memory."""

    name: str
    source: Any
    #: The state after the call (the ``on_error`` state when the body raised).
    target: Any
    #: Fields the body or a receiver changed, by attname (state and version left out).
    values: dict[str, Any]
    returned: Any = None
    #: What the body raised when fsm-2 moved the order to the ``on_error`` state.
    error: BaseException | None = None
    #: A receiver or the body saved the instance itself (in this transaction).
    saved: bool = False


_DEFERRED = object()


@cache
def _tracked(model: type[Model]) -> tuple[Any, ...]:
    return tuple(
        f for f in model._meta.concrete_fields if not f.primary_key and f.attname != "version"
    )


@cache
def _compared(model: type[Model]) -> tuple[tuple[str, Any], ...]:
    """The fields :func:`call_transition` compares (state left out): each attname, with
    the field where it is stamped ``auto_now`` (else None)."""
    state = state_field(model).attname
    return tuple(
        (f.attname, f if getattr(f, "auto_now", False) else None)
        for f in _tracked(model)
        if f.attname != state
    )


def snapshot_of(instance: Model) -> dict[str, Any]:
    """The instance's fields, as :func:`call_transition` compares and :func:`restore` sets them."""
    state = instance.__dict__
    taken: dict[str, Any] = {}
    for f in _tracked(type(instance)):
        value = state.get(f.attname, _DEFERRED)
        taken[f.attname] = copy.deepcopy(value) if isinstance(value, dict | list) else value
    return taken


def restore(instance: Model, snapshot: Mapping[str, Any], version: int) -> None:
    """Put ``instance`` back as :func:`snapshot_of` saw it (protected state fields too)."""
    for attname, value in snapshot.items():
        if value is _DEFERRED:
            instance.__dict__.pop(attname, None)
        else:
            instance.__dict__[attname] = value
    instance.__dict__["version"] = version
    instance._state.fields_cache.clear()


def call_transition(
    instance: Model,
    name: str,
    kwargs: Mapping[str, Any],
    *,
    fields: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, Any] | None = None,
) -> Ran:
    """Call the model's own transition method ``name`` on ``instance`` with ``kwargs``, as
    fsm-2 does (conditions, body, ``pre_transition``/``post_transition`` with the
    arguments, ``on_error``, ``RETURN_VALUE``/``GET_STATE``), and collect what it changed.

    ``fields`` (a validator's columns) are set on the instance first, so the body
    and the conditions see them. Nothing is written: :func:`commit` does that.
    An exception from the body, a condition or a receiver propagates, except
    where fsm-2's ``on_error`` moved the state: then it is kept in ``Ran.error``.
    """
    model = type(instance)
    field = state_field(model)
    before = snapshot if snapshot is not None else snapshot_of(instance)
    source = field.get_state(instance)
    for column, value in (fields or {}).items():
        setattr(instance, column, value)
    key = id(instance)
    _saves.watched[key] = False
    error: BaseException | None = None
    returned: Any = None
    try:
        returned = getattr(instance, name)(**kwargs)
    except Exception as exc:
        on_error = getattr(model, name)._django_fsm.exception_state(source)
        if on_error is None or field.get_state(instance) != on_error:
            raise
        error = exc
    finally:
        saved = _saves.watched.pop(key, False)
    values: dict[str, Any] = {}
    now = instance.__dict__
    # Where save() commits, it stamps auto_now itself, after its pre_save receivers.
    stamp = not save_hooks(model)
    for attname, stamped in _compared(model):
        value = now.get(attname, _DEFERRED)
        if value is _DEFERRED:
            continue
        if stamp and stamped is not None:
            values[attname] = stamped.pre_save(instance, False)
        elif value != before.get(attname, _DEFERRED):
            values[attname] = value
    return Ran(name, source, field.get_state(instance), values, returned, error, saved)


def still_committable(conn: Any) -> None:
    """After the project's code ran in the message's transaction, before it commits: raise
    :class:`~idempotent_orders.exceptions.TransactionAborted` where a database error
    aborted that transaction and the project's code caught it (PostgreSQL then answers
    ``COMMIT`` with a silent rollback: the message would be reported applied, and its
    redelivery taken for a duplicate, with nothing written)."""
    if vendor(conn).aborted(conn):
        raise TransactionAborted(
            "a database error aborted the message's transaction and the project's code "
            "caught it (a receiver, a body or a save() override): nothing was written"
        )


def commit(
    instance: Model,
    ran: Ran,
    version: int,
    extra_filters: Mapping[str, Any] | None = None,
    hold: Any = None,
) -> bool:
    """Write what :func:`call_transition` did, ``WHERE pk AND state AND version`` (and
    ``extra_filters``): through the model's ``save()`` where :func:`save_hooks` finds
    anything of the project's, else with one conditional UPDATE of the state, every
    changed field and ``version + 1``. False when another writer changed the row first.
    ``hold``: a :class:`~idempotent_orders.consuming.held.HeldUpdate` that may keep
    ``save()``'s UPDATE for the next text (then True says only that ``save()`` ran).
    """
    model = type(instance)
    field = state_field(model)
    states = [ran.source]
    conditions: dict[str, Any] = dict(extra_filters or {})
    if ran.saved:
        # Saved by a receiver in this very transaction: the row holds what the instance
        # holds already (the target, and columns such as last_seq set before the call).
        if ran.target != ran.source:
            states.append(ran.target)
        for name, expected in list(conditions.items()):
            held = getattr(instance, name, expected)
            if held != expected:
                del conditions[name]
                conditions[f"{name}__in"] = [expected, held]
    guard = {f"{field.attname}__in": states, "version": version, **conditions}
    if save_hooks(model):
        # save() writes every column: the sequence as read is a condition too (the
        # app moves last_seq on without a transition, and so without a new version).
        if "last_seq" not in guard and "last_seq__in" not in guard:
            guard["last_seq"] = getattr(instance, "last_seq", 0)
        return _save(instance, guard, version, hold)
    rows = model._default_manager.filter(pk=instance.pk, **guard).update(
        **{field.attname: ran.target, "version": F("version") + 1}, **ran.values
    )
    if rows != 1:
        return False
    instance.__dict__["version"] = version + 1
    return True


def _save(instance: Model, guard: Mapping[str, Any], version: int, hold: Any = None) -> bool:
    """Commit a transition through the model's own ``save()``, called as the project's
    code calls it after a transition (no ``update_fields``), with ``guard`` added to the
    UPDATE it sends (:meth:`~idempotent_orders.models.AbstractOrder._do_update`). Its
    override, ``pre_save``/``post_save`` receivers and history packages run as they do
    for ``order.pay(); order.save()``. False when another writer changed the row first
    (nothing after the UPDATE ran: the caller rolls back)."""
    instance.__dict__["version"] = version + 1
    instance.__dict__[SAVE_GUARD] = dict(guard)
    if hold is not None:
        instance.__dict__[SAVE_HOLD] = hold
    try:
        instance.save()
    except OrderChanged:
        instance.__dict__["version"] = version
        return False
    finally:
        unsent = instance.__dict__.pop(SAVE_GUARD, None) is not None
        instance.__dict__.pop(SAVE_HOLD, None)
    if unsent:
        # The project's save() returned without writing the row (it never reached
        # super().save()): the message must not be recorded as applied.
        model = type(instance)
        raise TransitionNotSaved(
            f"{model.__module__}.{model.__qualname__}.save() returned without writing "
            f"order {instance.pk}: the transition was not committed"
        )
    return True


def guarded_update_sql(
    conn: Any,
    meta: Options[Any],
    state_column: str,
    values: Sequence[Field[Any, Any]],
    conditions: Sequence[Field[Any, Any]],
) -> str:
    """:func:`commit`'s UPDATE as SQL, for a road that sends it as a text of its own:
    ``UPDATE <table> SET <state> = %s, version = version + 1, <value> = %s ... WHERE <pk> =
    %s AND <state> = %s AND version = %s AND <condition> = %s ...``; the arguments in that
    order (the state as read)."""
    qn = conn.ops.quote_name
    state = qn(state_column)
    version = qn(str(meta.get_field("version").column))  # type: ignore[union-attr]
    assert meta.pk is not None
    sets = [f"{state} = %s", f"{version} = {version} + 1"]
    sets += [f"{qn(str(f.column))} = %s" for f in values]
    where = [
        f"{qn(str(meta.pk.column))} = %s",
        f"{state} = %s",
        f"{version} = %s",
    ]
    where += [f"{qn(str(f.column))} = %s" for f in conditions]
    return f"UPDATE {qn(meta.db_table)} SET {', '.join(sets)} WHERE {' AND '.join(where)}"


class _Lost(Exception):
    """The conditional UPDATE found the row changed: undo what the body wrote."""


def apply_transition(
    instance: Model,
    name: str,
    *,
    fields: Mapping[str, Any] | None = None,
    extra_filters: Mapping[str, Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> TransitionResult:
    """Run transition ``name`` (the model's own method) and commit it with one conditional
    UPDATE; never raises on a lost race.

    ``UPDATE ... SET <state>=:target, version=version+1, <changed fields> WHERE
    id=:id AND <state>=:source AND version=:v``. The method runs as fsm-2 runs it
    (conditions, body, signals, ``on_error``) with ``kwargs``; what its body
    creates is written in the same transaction (a savepoint, when the caller
    has one). On success the instance matches the row; on any other result it
    is left as it was read, so it never holds a state the database does not.
    ``extra_filters`` add conditions to the WHERE clause. An exception from the
    method propagates, after its writes were rolled back.
    """
    checked = check_transition(instance, name)
    if not checked.applied:
        return checked
    version: int = instance.version  # type: ignore[attr-defined]
    before = snapshot_of(instance)
    # Only the project's code can write other rows; without any, no savepoint is needed.
    atomic = (
        transaction.atomic(using=instance._state.db)
        if runs_user_code(type(instance), name)
        else contextlib.nullcontext()
    )
    try:
        with atomic:
            ran = call_transition(instance, name, kwargs or {}, fields=fields, snapshot=before)
            if not commit(instance, ran, version, extra_filters):
                raise _Lost
            result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
            transition_written(instance, name, result, fsm_sent=True)
    except _Lost:
        restore(instance, before, version)
        return TransitionResult(TransitionStatus.CONFLICT, checked.source, ran.target, version)
    except BaseException:
        restore(instance, before, version)
        raise
    if ran.error is not None:
        return TransitionResult(TransitionStatus.FAILED, ran.source, ran.target, version + 1)
    return result
