"""Django REST framework support (the ``drf`` extra): :class:`IdempotentAPIViewMixin`."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from idempotent_orders.http.decorators import OnFailure, Policy, guard
from idempotent_orders.http.keys import UNSAFE_METHODS, default_principal, header_key
from idempotent_orders.http.problems import problem_response

__all__ = ["IdempotentAPIViewMixin"]


class IdempotentAPIViewMixin:
    """Mix into an ``APIView``, a generic view or a ``ViewSet`` (routers included):
    POST, PUT, PATCH and DELETE run once per ``Idempotency-Key``; safe methods
    pass through.

    The principal is resolved through the view's own DRF authenticators (token,
    session, ...), before the key is claimed, so API clients authenticated by
    DRF get their own scope. Set ``idempotency_required = False`` to let keyless
    requests through, and ``idempotency_on_failure`` to choose what a failure
    leaves behind (see :func:`~idempotent_orders.http.idempotent_view`).
    """

    idempotency_required: bool = True
    #: See ``on_failure`` of :func:`~idempotent_orders.http.idempotent_view`.
    idempotency_on_failure: OnFailure | None = None

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        # A ViewSet's as_view takes the router's {method: action} map first.
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        policy = Policy(required=cls.idempotency_required, on_failure=cls.idempotency_on_failure)
        guarded = guard(view, policy, header_key)

        @functools.wraps(guarded)
        def with_drf_principal(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method in UNSAFE_METHODS and not hasattr(request, "_idempotency_principal"):
                try:
                    principal = _drf_principal(cls, initkwargs, request)
                except _LoginFailed as failed:
                    # Credentials were sent and refused: no key is claimed (and no
                    # anonymous session made up to hold one), the caller is told so.
                    return failed.response
                request._idempotency_principal = principal  # type: ignore[attr-defined]
            return guarded(request, *args, **kwargs)

        return with_drf_principal


class _LoginFailed(Exception):
    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__(response)
        self.response = response


def _drf_principal(cls: Any, initkwargs: dict[str, Any], request: HttpRequest) -> str | None:
    """The caller as the view's DRF authenticators see it; raise :class:`_LoginFailed`
    (a 401 problem) when one of them refuses the credentials sent."""
    from rest_framework.exceptions import APIException
    from rest_framework.request import Request

    view = cls(**initkwargs)
    authenticators = view.get_authenticators()
    try:
        user = Request(request, authenticators=authenticators).user
    except APIException as exc:
        response = problem_response(
            401, "not-authenticated", "Authentication failed", str(exc.detail)
        )
        for authenticator in authenticators:
            header = authenticator.authenticate_header(request)
            if header:
                response["WWW-Authenticate"] = header
                break
        raise _LoginFailed(response) from None
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return default_principal(request)


if importlib.util.find_spec("drf_spectacular") is not None:
    # Describe these views' keyed operations in drf-spectacular's schema.
    from idempotent_orders.contrib import spectacular  # noqa: F401
