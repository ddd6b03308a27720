"""The testing kit's eyes outside the database: a project's effects, counted per business event.

The database alone cannot show an e-mail sent twice or a payment captured twice: a
transition body or a receiver that calls a gateway runs again for every attempt of a
message (a worker that died before its commit, a race lost to another worker), and
the rolled-back attempts leave no row behind. :func:`watch_effects` counts the calls
of the effects a test declares, each by the business event it is for, across the
kit's crashes, copies, shuffles, batches, threads and event loop, and fails when one
ran twice: with the effect, the message being consumed and the crash point of each
call.

An effect is declared by dotted path (the function or method is replaced by a
counting wrapper for the block, in every module that imported it by name), as
``"mail"`` (every e-mail Django sends), as an :class:`Effect` (a path with a name or
a key of its own), or in the project's code with
:func:`idempotent_orders.effects.effect`, which every watcher counts.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib
import inspect
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Call",
    "Effect",
    "EffectBeforeCommit",
    "Effects",
    "delivery",
    "watch_effects",
    "worker_died",
]

#: Where the docs say where an effect belongs (the warnings and failures point there).
WHERE_EFFECTS_BELONG = 'docs/testing.md, "Where an effect belongs"'


class EffectBeforeCommit(UserWarning):
    """An effect was called while its transaction was open (a transition body, a receiver,
    a ``save()``): it happens again whenever the attempt rolls back."""


@dataclass(frozen=True)
class Effect:
    """An effect to watch: the function or method at ``path`` (dotted).

    ``name`` is how failures call it (the path by default). ``key(call)`` returns the
    business event a call is for (hashable); by default the call's arguments (without
    ``self`` for a method): two calls with equal arguments are the same effect twice.
    """

    path: str
    name: str | None = None
    key: Callable[[Call], Hashable] | None = None
    #: How a call is shown in a failure; by default its arguments.
    show: Callable[[Call], str] | None = None

    @property
    def label(self) -> str:
        return self.name or self.path


def _mail_key(call: Call) -> Hashable:
    message = call.args[0]
    return (message.subject, tuple(message.to), tuple(message.cc), tuple(message.bcc), message.body)


def _mail_shown(call: Call) -> str:
    message = call.args[0]
    return f"{message.subject!r} to {', '.join(message.to) or '(nobody)'}"


#: Declarations known by a short name.
BUILT_IN = {
    # send_mail(), mail_admins(), EmailMessage.send(): every one goes through send().
    "mail": Effect(
        "django.core.mail.message.EmailMessage.send", "mail", key=_mail_key, show=_mail_shown
    ),
}


@dataclass
class Call:
    """One call of a watched effect."""

    effect: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The business event (see :class:`Effect`).
    key: Hashable = None
    #: The call as a failure shows it.
    shown: str = ""
    #: The message being consumed (``consumer/message_id``), or the kit's delivery; None: neither.
    message: str | None = None
    #: Called while a transaction was open on the default database (not a test's own).
    before_commit: bool = False
    #: Inside a transition (its body, a condition or a receiver of its signals).
    in_transition: bool = False
    #: The project's line that made the call: ``path:line in function``.
    where: str = ""
    thread: str = ""
    #: The crash point the delivery making this call died at; None: it did not die.
    died_at: str | None = None

    def describe(self) -> str:
        parts = [f"message {self.message}" if self.message else "outside any message"]
        if self.before_commit:
            inside = "inside a transition" if self.in_transition else "inside a transaction"
            parts.append(f"{inside}, before commit")
        else:
            parts.append("no transaction open")
        parts.append(f"at {self.where}")
        if self.thread != "MainThread":
            parts.append(f"thread {self.thread}")
        text = ", ".join(parts)
        if self.died_at:
            text += f"; then the worker died at {self.died_at}"
        return text


# --- what the kit's deliveries and crash points tell the watchers -----------------------------

#: The kit's delivery running in this context: its label and the calls it made so far.
_delivery: contextvars.ContextVar[tuple[str, list[Call]] | None] = contextvars.ContextVar(
    "idempotent_orders_kit_delivery", default=None
)
#: Calls made outside any kit delivery, per thread, since the last crash there.
_loose = threading.local()


@contextmanager
def delivery(label: str) -> Iterator[None]:
    """The kit is delivering ``label`` (``consumer/message_id``, or a batch) in this context."""
    token = _delivery.set((label, []))
    try:
        yield
    finally:
        _delivery.reset(token)


def _attempt() -> list[Call]:
    held = _delivery.get()
    if held is not None:
        return held[1]
    calls: list[Call] | None = getattr(_loose, "calls", None)
    if calls is None:
        calls = _loose.calls = []
    return calls


def worker_died(point: str) -> None:
    """The delivery in this context dies at crash ``point``: its calls so far were made by
    an attempt that never committed."""
    attempt = _attempt()
    for call in attempt:
        if call.died_at is None:
            call.died_at = point
    attempt.clear()


# --- where a call comes from ------------------------------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The kit's own files, the effect marker and contextlib: never the project's line.
_SKIPPED: tuple[str, ...] = (
    _HERE + os.sep,
    os.path.abspath(os.path.join(_HERE, os.pardir, "effects.py")),
    os.path.abspath(contextlib.__file__),
)


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name) or importlib.import_module(name)
    file = getattr(module, "__file__", None)
    return None if file is None else os.path.dirname(os.path.abspath(file)) + os.sep


def _origin() -> tuple[str, bool]:
    """``path:line in function`` of the project's frame that made the call (Django's own
    frames, such as ``send_mail()`` around ``EmailMessage.send()``, skipped), and whether
    a transition is running (a django-fsm frame below it)."""
    django_dir = _package_dir("django")
    fsm_dir = _package_dir("django_fsm")
    where = ""
    in_transition = False
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if fsm_dir and path.startswith(fsm_dir):
            in_transition = True
            break
        project = not path.startswith(_SKIPPED) and not (django_dir and path.startswith(django_dir))
        if not where and project:
            where = f"{_relative(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return where or "?", in_transition


def _relative(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith(os.pardir) else relative


def _transaction_open() -> bool:
    """Whether the default database has a transaction open that is not the test's own
    (pytest-django's ``db`` wraps a test in one that never commits)."""
    from django.db import connection

    if connection.in_atomic_block:
        return any(
            not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks
        )
    return connection.connection is not None and not connection.autocommit


def _message() -> str | None:
    from idempotent_orders.consuming.envelope import current_message

    consumed = current_message()
    if consumed is not None:
        return f"{consumed.consumer}/{consumed.message_id}"
    held = _delivery.get()
    return None if held is None else held[0]


# --- the watcher ------------------------------------------------------------------------------

_watchers: list[Effects] = []
_lock = threading.Lock()


class Effects:
    """What :func:`watch_effects` gives a test: the calls of the watched effects.

    ``calls`` (every call, in order), :meth:`count` and :meth:`problems`;
    :meth:`assert_once` fails with every effect that ran more than once for one
    business event (and, with ``before_commit="fail"``, every call made before its
    transaction committed).
    """

    def __init__(self, before_commit: Literal["warn", "fail", "ignore"] = "warn") -> None:
        if before_commit not in ("warn", "fail", "ignore"):
            raise ValueError(f"before_commit must be warn, fail or ignore, not {before_commit!r}")
        self.before_commit = before_commit
        self.calls: list[Call] = []

    def count(self, effect: str | None = None) -> collections.Counter[Hashable]:
        """How many times each business event's effect ran: ``{(effect, key): n}``, or
        ``{key: n}`` for one ``effect``."""
        if effect is not None:
            return collections.Counter(c.key for c in self.calls if c.effect == effect)
        return collections.Counter((c.effect, c.key) for c in self.calls)

    def problems(self) -> list[str]:
        """Every effect done twice (each call with its message, place and crash point),
        then, with ``before_commit="fail"``, every effect called before commit."""
        by_event: dict[tuple[str, Hashable], list[Call]] = {}
        for call in self.calls:
            by_event.setdefault((call.effect, _hashable(call.key)), []).append(call)
        problems: list[str] = []
        for (effect, _), calls in by_event.items():
            if len(calls) < 2:
                continue
            lines = [f"{effect} {calls[0].shown} ran {len(calls)} times for one business event:"]
            lines += [f"    {n}. {call.describe()}" for n, call in enumerate(calls, 1)]
            problems.append("\n".join(lines))
        if problems and any(c.before_commit for c in self.calls):
            problems.append(
                "an effect called before its transaction commits runs again for every "
                f"attempt that rolls back: see {WHERE_EFFECTS_BELONG}"
            )
        if self.before_commit == "fail":
            early = [c for c in self.calls if c.before_commit]
            problems += [
                f"{c.effect} {c.shown} called before commit ({c.describe()}): "
                f"see {WHERE_EFFECTS_BELONG}"
                for c in early
            ]
        return problems

    def assert_once(self) -> None:
        """Fail when an effect ran more than once for one business event (see :meth:`problems`)."""
        problems = self.problems()
        if problems:
            raise AssertionError("effects not exactly once:\n  " + "\n  ".join(problems))

    def record(self, call: Call) -> None:
        call.where, call.in_transition = _origin()
        call.before_commit = _transaction_open()
        call.message = _message()
        call.thread = threading.current_thread().name
        with _lock:
            self.calls.append(call)
        _attempt().append(call)

    def warn_before_commit(self) -> None:
        """One :class:`EffectBeforeCommit` warning per effect and place called before commit
        (at the end of the block, not inside the project's transaction)."""
        seen: set[tuple[str, str]] = set()
        for call in self.calls:
            if not call.before_commit or (call.effect, call.where) in seen:
                continue
            seen.add((call.effect, call.where))
            inside = "a transition" if call.in_transition else "a transaction"
            warnings.warn(
                EffectBeforeCommit(
                    f"{call.effect} called inside {inside}, before commit, at {call.where}: "
                    "it happens again whenever the attempt rolls back (a crash, a lost race)."
                    " Call it from transaction.on_commit, the outbox or a leased effect:"
                    f" see {WHERE_EFFECTS_BELONG}"
                ),
                stacklevel=4,
            )


def _hashable(key: Hashable) -> Hashable:
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key


def _observe(name: str, key: dict[str, Any]) -> None:
    """A block marked with :func:`idempotent_orders.effects.effect` starts."""
    event: Hashable = tuple(sorted(key.items())) if key else ("message", _message())
    shown = "(" + ", ".join(f"{k}={v!r}" for k, v in sorted(key.items())) + ")"
    for watcher in tuple(_watchers):
        watcher.record(Call(name, (), dict(key), key=_hashable(event), shown=shown))


# --- patching a dotted path -------------------------------------------------------------------


def _resolve(path: str) -> tuple[Any, str]:
    """The object holding ``path``'s last attribute (a module or a class), and its name."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:-1]:
                owner = getattr(owner, part)
            getattr(owner, parts[-1])
        except AttributeError:
            break
        return owner, parts[-1]
    raise ValueError(f"cannot find the effect {path!r}: a dotted path to a function or method")


def _default_shown(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    return f"({shown if len(shown) <= 200 else shown[:197] + '...'})"


def _wrapper(effect: Effect, function: Callable[..., Any], method: bool) -> Callable[..., Any]:
    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        shown_args = args[1:] if method else args
        call = Call(effect.label, args, kwargs)
        call.key = _hashable(
            effect.key(call)
            if effect.key
            else (repr(shown_args), repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
        )
        call.shown = effect.show(call) if effect.show else _default_shown(shown_args, kwargs)
        for watcher in tuple(_watchers):
            watcher.record(call)
        return function(*args, **kwargs)

    return counted


@contextmanager
def _patched(effect: Effect) -> Iterator[None]:
    owner, name = _resolve(effect.path)
    undo: list[Callable[[], None]] = []
    if isinstance(owner, type):
        static = inspect.getattr_static(owner, name)
        own = name in vars(owner)
        if isinstance(static, staticmethod | classmethod):
            replacement: Any = type(static)(
                _wrapper(effect, static.__func__, isinstance(static, classmethod))
            )
        else:
            replacement = _wrapper(effect, static, True)
        setattr(owner, name, replacement)
        undo.append(
            (lambda: setattr(owner, name, static)) if own else (lambda: delattr(owner, name))
        )
    else:
        original = getattr(owner, name)
        replacement = _wrapper(effect, original, False)
        # The module that defines it and every module that imported it by name.
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)
                    undo.append(functools.partial(setattr, module, attr, original))
        if getattr(owner, name) is original:  # not a module in sys.modules
            setattr(owner, name, replacement)
            undo.append(functools.partial(setattr, owner, name, original))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


@contextmanager
def watch_effects(
    *effects: str | Effect, before_commit: Literal["warn", "fail", "ignore"] = "warn"
) -> Iterator[Effects]:
    """Count the calls of ``effects`` (dotted paths, ``"mail"`` or :class:`Effect`) and of
    every :func:`idempotent_orders.effects.effect` block, per business event.

    Fails at the end of the block when one ran more than once for one business event;
    :func:`~idempotent_orders.testing.assert_exactly_once` inside the block fails on it
    too. ``before_commit``: an effect called while its transaction is open (a transition
    body, a receiver outside ``on_commit``) is a warning (``"warn"``,
    :class:`EffectBeforeCommit`), a failure (``"fail"``) or nothing (``"ignore"``).
    """
    from idempotent_orders import effects as marker

    declared = [BUILT_IN.get(e, Effect(e)) if isinstance(e, str) else e for e in effects]
    watcher = Effects(before_commit)
    with contextlib.ExitStack() as stack:
        for effect in declared:
            stack.enter_context(_patched(effect))
        with _lock:
            _watchers.append(watcher)
            if _observe not in marker._observers:
                marker._observers.append(_observe)
        try:
            yield watcher
        finally:
            with _lock:
                _watchers.remove(watcher)
                if not _watchers:
                    marker._observers.remove(_observe)
    watcher.assert_once()
    if before_commit == "warn":
        watcher.warn_before_commit()


def active_problems() -> list[str]:
    """The problems of every watcher open now (for ``assert_exactly_once``)."""
    return [p for watcher in tuple(_watchers) for p in watcher.problems()]
