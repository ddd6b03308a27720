"""``@idempotent_view`` and :class:`IdempotentMixin`: the key's steps around a view, sync or async.

The steps themselves are in their own modules: parse (:mod:`~idempotent_orders.http.header`),
claim (:mod:`~idempotent_orders.http.claims`), lease (:mod:`~idempotent_orders.http.lease`),
store and replay (:mod:`~idempotent_orders.http.replay`). Around a view they run in this order:
:func:`_begin` (key, principal, fingerprint, claim: answered at once for a
replay or an error), the view under the heartbeat, then the stored response.
A sync view and an async view share these functions; an async view is awaited
on the event loop, and the database steps before and after it run in a thread
(``sync_to_async``), one hop each, so the loop is never blocked on the database.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from django.http import HttpRequest, HttpResponseBase
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.consuming.failures import is_retryable
from idempotent_orders.exceptions import (
    IdempotencyError,
    KeyInFlight,
    KeyMissing,
    NotAuthenticated,
    SessionRequired,
)
from idempotent_orders.http.claims import claim, release
from idempotent_orders.http.header import (
    HEADER,
    UNSAFE_METHODS,
    check_length,
    fingerprint,
    header_key,
    read_body,
)
from idempotent_orders.http.lease import KeyClaim, heartbeat
from idempotent_orders.http.principals import get_principal, scope_of
from idempotent_orders.http.problems import problem_from, problem_response
from idempotent_orders.http.replay import replay, store
from idempotent_orders.models import IdempotencyKey, KeyState
from idempotent_orders.orders import RaceLost, reruns_on_race
from idempotent_orders.signals import idempotent_request

__all__ = ["IdempotentMixin", "idempotent_view"]

View = Callable[..., Any]
V = TypeVar("V", bound=View)
KeyOf = Callable[[HttpRequest], str | None]

#: What a keyed view's failure (an exception, or a 5xx response) does:
#: ``rollback`` runs the view in a transaction, rolled back before the key is
#: released; ``store`` keeps the failure as the key's answer; ``release``
#: releases the key and rolls nothing back (for views that write nothing).
OnFailure = Literal["rollback", "store", "release"]
ON_FAILURE: tuple[OnFailure, ...] = ("rollback", "store", "release")


@dataclass(frozen=True)
class FormRules:
    """What changes for a token-protected form (see :mod:`idempotent_orders.http.forms`)."""

    #: The request's fingerprint from its parsed fields (a form's body may be streamed).
    fingerprint: Callable[[HttpRequest], str]
    #: The answer to a second submit of a completed token: where the first one went.
    redirect: Callable[[IdempotencyKey], HttpResponseBase]


@dataclass(frozen=True)
class Policy:
    """How a view treats keys: required or optional; a header key, or a form's token."""

    required: bool = True
    form: FormRules | None = None
    #: None: ``rollback`` for a ``def`` view, ``store`` for an ``async def`` one
    #: (Django runs no async view in a transaction, so it cannot be rolled back).
    on_failure: OnFailure | None = None

    def failure_for(self, view: View) -> OnFailure:
        """What a failure of ``view`` does under this policy."""
        asynchronous = iscoroutinefunction(view)
        if self.on_failure is None:
            return "store" if asynchronous else "rollback"
        if self.on_failure not in ON_FAILURE:
            raise ImproperlyConfigured(
                f"on_failure must be one of {', '.join(ON_FAILURE)}, not {self.on_failure!r}"
            )
        if asynchronous and self.on_failure == "rollback":
            raise ImproperlyConfigured(
                "an async view runs outside any transaction and cannot be rolled back:"
                " use on_failure='store' (or 'release' if it writes nothing)"
            )
        return self.on_failure


@dataclass
class _Start:
    """How a request begins: answered without the view, or the view runs (holding ``held``)."""

    key: str | None = None
    answer: HttpResponseBase | None = None
    held: KeyClaim | None = None


def _begin(request: HttpRequest, policy: Policy, key_of: KeyOf) -> _Start:
    """Everything before the view: the key, the principal, the fingerprint and the claim."""
    key: str | None = None
    try:
        key = key_of(request)
        if key is None:
            if policy.required:
                raise KeyMissing(f"send an {HEADER} header (or a token) with this request")
            return _Start()
        principal = get_principal(request)
        if principal is None:
            raise _unauthenticated(request)
        if policy.form:
            # A form's fields were parsed already (maybe streamed: multipart), so
            # the limit is checked on the declared length and the fields hashed.
            check_length(request)
            fp = policy.form.fingerprint(request)
        else:
            fp = fingerprint(request, read_body(request))
        outcome = claim(
            principal=principal,
            key=key,
            method=request.method or "",
            route=request.path,
            fingerprint=fp,
            is_form=policy.form is not None,
        )
    except IdempotencyError as exc:
        if key is not None and policy.form and isinstance(exc, KeyInFlight):
            waited = _wait_for_first(request, key, policy)
            if waited is not None:
                return _Start(key, answer=waited)
        if key is not None:
            _announce(request, key, exc.code)
        return _Start(key, answer=problem_from(exc))
    if isinstance(outcome, IdempotencyKey):
        return _Start(key, answer=_answer_completed(request, key, outcome, policy))
    return _Start(key, held=outcome)


def _unauthenticated(request: HttpRequest) -> NotAuthenticated:
    session = getattr(request, "session", None)
    if session is not None and not session.session_key:
        return SessionRequired(
            "an anonymous caller's key needs a session, or each request would be a new"
            " caller: load a page of this site first (its response sets the session"
            " cookie) and send that cookie with every request, or log in"
        )
    return NotAuthenticated("idempotency keys need an authenticated caller or a session")


def _announce(request: HttpRequest, key: str, outcome: str) -> None:
    idempotent_request.send(sender=IdempotencyKey, request=request, key=key, outcome=outcome)


def _answer_completed(
    request: HttpRequest, key: str, row: IdempotencyKey, policy: Policy
) -> HttpResponseBase:
    if policy.form:
        _announce(request, key, "redirected")
        return policy.form.redirect(row)
    _announce(request, key, "replayed")
    return replay(row)


def _wait_for_first(request: HttpRequest, key: str, policy: Policy) -> HttpResponseBase | None:
    """A form's second submit waits for the first one, then lands on the same result."""
    principal = get_principal(request) or ""
    scope = scope_of(principal, request.method or "", request.path)
    deadline = time.monotonic() + conf.FORM_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.1)
        row = IdempotencyKey.objects.filter(scope=scope, key=key).first()
        if row is None:
            return None  # released (the first submit failed): answer 409, the user retries
        if row.state == KeyState.COMPLETED:
            return _answer_completed(request, key, row, policy)
        if row.lease_expires_at is not None and row.lease_expires_at <= timezone.now():
            return None
    return None


def _atomic_requests(aliases: list[str] | None = None) -> AbstractContextManager[Any]:
    """``transaction.atomic()`` for each database with ``ATOMIC_REQUESTS``, as Django
    would (or for each of ``aliases``)."""
    if aliases is None:
        aliases = _atomic_aliases()
    if not aliases:
        return nullcontext()
    stack = ExitStack()
    for alias in aliases:
        stack.enter_context(transaction.atomic(using=alias))
    return stack


def _atomic_aliases() -> list[str]:
    # The settings themselves (each connection's settings_dict is its entry here):
    # reading them through the connections would look each one up context-locally.
    return [alias for alias, db in connections.settings.items() if db.get("ATOMIC_REQUESTS")]


def _view_aliases(on_failure: OnFailure) -> list[str]:
    """The databases whose transaction a keyed view runs in: those with
    ``ATOMIC_REQUESTS``, and under ``rollback`` the default one (the key's) too."""
    aliases = _atomic_aliases()
    if on_failure == "rollback" and DEFAULT_DB_ALIAS not in aliases:
        aliases = [DEFAULT_DB_ALIAS, *aliases]
    return aliases


class _LostClaim(Exception):
    """Raised inside the request's transaction to roll back a holder that lost its claim."""


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        rendered = render()
        return rendered if isinstance(rendered, HttpResponseBase) else response
    return response


def _store_if_kept(
    held: KeyClaim,
    response: HttpResponseBase,
    policy: Policy,
    on_failure: OnFailure,
    *,
    commit: bool = False,
) -> bool | None:
    """Store a response worth keeping (a success, a form's redirect, a 5xx under
    ``store``): whether it was stored (False: the claim was lost), or None when the
    key is to be released. ``commit``: see :func:`~idempotent_orders.http.replay.store`."""
    status = response.status_code
    failed = status >= 500
    keep = on_failure == "store" if failed else not policy.form or 300 <= status < 400
    return store(held, response, commit=commit) if keep else None


def _failed_answer() -> HttpResponseBase:
    """What a key whose view raised answers under ``store``."""
    return problem_response(
        500,
        "view-failed",
        "The request failed",
        "the first request with this key raised an error; send a new key to try again",
    )


def _after_exception(
    request: HttpRequest, key: str, held: KeyClaim, on_failure: OnFailure, exc: BaseException
) -> None:
    """The key of a view that raised ``exc`` (its transaction, if any, rolled back)."""
    if on_failure == "store" and isinstance(exc, Exception):
        # Not a BaseException (a cancelled request, an exiting worker): those release.
        _settle(request, key, held, store(held, _failed_answer()))
    else:
        _give_back(request, key, held)


def _settle(request: HttpRequest, key: str, held: KeyClaim, stored: bool | None) -> None:
    if stored is None:
        _give_back(request, key, held)
    else:
        _announce(request, key, "executed" if stored else "lease-lost")


def _give_back(request: HttpRequest, key: str, held: KeyClaim) -> None:
    """Release the key (5xx, exception, invalid form): the client may retry with it."""
    release(held)
    _announce(request, key, "released")


def _answer_lost(
    request: HttpRequest, key: str, held: KeyClaim, policy: Policy
) -> HttpResponseBase:
    """What a later copy of the request gets: the winner's stored response, or 409."""
    row = IdempotencyKey.objects.filter(pk=held.row.pk).first()
    if (
        row is not None
        and row.state == KeyState.COMPLETED
        and row.fingerprint == held.row.fingerprint
    ):
        return _answer_completed(request, key, row, policy)
    exc = KeyInFlight(
        "a request with this key is still being processed", retry_after=conf.RETRY_AFTER
    )
    _announce(request, key, exc.code)
    return problem_from(exc)


def _execute(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    policy: Policy,
    on_failure: OnFailure,
    key: str,
    held: KeyClaim,
) -> HttpResponseBase:
    aliases = _view_aliases(on_failure)
    try:
        with heartbeat(held):
            try:
                response, stored = _run_in_transaction(view, held, policy, on_failure, aliases)
            except _LostClaim:
                return _answer_lost(request, key, held, policy)
    except BaseException as exc:
        _after_exception(request, key, held, on_failure, exc)
        raise
    _settle(request, key, held, stored)
    return response


#: Times a view whose transaction the database chose as a deadlock victim (or in which
#: ``create_order`` lost the race for its order: :class:`~idempotent_orders.orders.RaceLost`)
#: runs again.
DEADLOCK_RETRIES = 3


def _run_in_transaction(
    view: Callable[[], HttpResponseBase],
    held: KeyClaim,
    policy: Policy,
    on_failure: OnFailure,
    aliases: list[str],
) -> tuple[HttpResponseBase, bool | None]:
    """Run the view (in its transaction when ``aliases``) and store its response.

    A deadlock or serialization failure rolled the whole transaction back (the
    key's claim, committed before, stays): the view simply runs again, as a
    client's retry would, at most :data:`DEADLOCK_RETRIES` times. So does a
    view whose ``create_order`` lost its race (it took no savepoint, see
    :func:`~idempotent_orders.orders.reruns_on_race`): the next run finds the
    winner's order.
    """
    for attempt in range(DEADLOCK_RETRIES + 1):
        try:
            return _run_once(view, held, policy, on_failure, aliases)
        except RaceLost:
            if not aliases or attempt == DEADLOCK_RETRIES:
                raise
        except OperationalError as exc:
            if not aliases or attempt == DEADLOCK_RETRIES or not is_retryable(exc):
                raise
            time.sleep(random.uniform(0.005, 0.03) * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _run_once(
    view: Callable[[], HttpResponseBase],
    held: KeyClaim,
    policy: Policy,
    on_failure: OnFailure,
    aliases: list[str],
) -> tuple[HttpResponseBase, bool | None]:
    with _atomic_requests(aliases), reruns_on_race() if aliases else nullcontext():
        response = _rendered(view())
        # In a transaction the response commits with the view's writes; when the
        # key's database is the only one, the statement storing it commits them.
        stored = _store_if_kept(
            held, response, policy, on_failure, commit=aliases == [DEFAULT_DB_ALIAS]
        )
        if stored is False and aliases:
            # The lease lapsed and another request took the key over: its
            # execution is the one the key answers, so this one must not
            # commit a second.
            raise _LostClaim
        if stored is None and response.status_code >= 500 and aliases:
            # A failure whose key is released: its writes must not stay,
            # or the retry would make them again.
            for alias in aliases:
                transaction.set_rollback(True, using=alias)
    return response, stored


async def _aexecute(
    request: HttpRequest,
    view: Callable[[], Awaitable[HttpResponseBase]],
    policy: Policy,
    on_failure: OnFailure,
    key: str,
    held: KeyClaim,
) -> HttpResponseBase:
    # Django runs no async view in a transaction (ATOMIC_REQUESTS does not apply):
    # the view commits its own writes, so a failure is stored, or released.
    try:
        with heartbeat(held):
            response = await view()
            render = getattr(response, "render", None)
            if callable(render) and not getattr(response, "is_rendered", True):
                response = await sync_to_async(_rendered)(response)
    except BaseException as exc:
        await sync_to_async(_after_exception)(request, key, held, on_failure, exc)
        raise

    def conclude() -> None:
        try:
            stored = _store_if_kept(held, response, policy, on_failure)
        except BaseException:
            _give_back(request, key, held)
            raise
        _settle(request, key, held, stored)

    await sync_to_async(conclude)()
    return response


def guard(view: View, policy: Policy, key_of: KeyOf) -> View:
    """``view`` running once per key under ``policy``, the key read by ``key_of``; async if
    ``view`` is. What :func:`idempotent_view`, the mixins, the form decorator and the
    DRF integration are built on."""
    on_failure = policy.failure_for(view)
    wrapper: View
    if iscoroutinefunction(view):

        @functools.wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            if request.method not in UNSAFE_METHODS:
                return await view(request, *args, **kwargs)
            start = await sync_to_async(_begin)(request, policy, key_of)
            if start.answer is not None:
                return start.answer
            if start.held is None or start.key is None:
                return await view(request, *args, **kwargs)
            return await _aexecute(
                request,
                lambda: view(request, *args, **kwargs),
                policy,
                on_failure,
                start.key,
                start.held,
            )

        wrapper = async_wrapper
    else:

        @functools.wraps(view)
        def sync_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            if request.method not in UNSAFE_METHODS:
                with _atomic_requests():
                    return view(request, *args, **kwargs)
            start = _begin(request, policy, key_of)
            if start.answer is not None:
                return start.answer
            if start.held is None or start.key is None:
                with _atomic_requests():
                    return _rendered(view(request, *args, **kwargs))
            return _execute(
                request,
                lambda: view(request, *args, **kwargs),
                policy,
                on_failure,
                start.key,
                start.held,
            )

        wrapper = sync_wrapper
    # The claim must commit before the view runs, so Django's ATOMIC_REQUESTS
    # wrapper is replaced by our own around the view (see _atomic_requests).
    return transaction.non_atomic_requests(wrapper)


def idempotent_view(
    view: V | None = None, *, required: bool = True, on_failure: OnFailure | None = None
) -> Any:
    """Decorate a view (``def`` or ``async def``): POST/PUT/PATCH/DELETE run once per key.

    ``@idempotent_view`` requires the ``Idempotency-Key`` header (400 without
    it); ``@idempotent_view(required=False)`` runs keyless requests normally. A
    token from the token endpoint works as the key. Safe methods pass through.

    ``on_failure`` says what a view that raises or answers 5xx leaves behind:
    ``"rollback"`` (a ``def`` view's default) runs the view in a transaction
    that is rolled back before the key is released; ``"store"`` (an ``async
    def`` view's default) keeps the failure as the key's answer; ``"release"``
    releases the key and rolls nothing back, for views that write nothing.
    """

    def decorate(func: V) -> V:
        guarded: Any = guard(func, Policy(required=required, on_failure=on_failure), header_key)
        return guarded

    return decorate(view) if view is not None else decorate


class IdempotentMixin:
    """Class-based-view mixin with the same behaviour as :func:`idempotent_view`."""

    idempotency_required: bool = True
    #: See ``on_failure`` of :func:`idempotent_view`.
    idempotency_on_failure: OnFailure | None = None

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        policy = Policy(required=cls.idempotency_required, on_failure=cls.idempotency_on_failure)
        return guard(view, policy, header_key)
