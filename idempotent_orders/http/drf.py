"""Django REST framework support (the ``drf`` extra): :class:`IdempotentAPIViewMixin`."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponseBase

from idempotent_orders.http.keys import Policy, _guarded, default_principal, header_key


class IdempotentAPIViewMixin:
    """Mix into an ``APIView``: unsafe methods run once per ``Idempotency-Key``.

    The principal is resolved through the view's own DRF authenticators (token,
    session, ...), before the key is claimed, so API clients authenticated by
    DRF get their own scope. Set ``idempotency_required = False`` to let keyless
    requests through.
    """

    idempotency_required: bool = True

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        view = super().as_view(**initkwargs)  # type: ignore[misc]
        guarded = _guarded(view, Policy(required=cls.idempotency_required), header_key)

        def with_drf_principal(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not hasattr(request, "_idempotency_principal"):
                request._idempotency_principal = _drf_principal(cls, request)  # type: ignore[attr-defined]
            return guarded(request, *args, **kwargs)

        with_drf_principal.__dict__.update(guarded.__dict__)
        return with_drf_principal


def _drf_principal(cls: Any, request: HttpRequest) -> str | None:
    from rest_framework.exceptions import APIException

    view = cls()
    view.args, view.kwargs, view.headers = (), {}, {}
    view.format_kwarg = None
    try:
        drf_request = view.initialize_request(request)
        user = drf_request.user
    except APIException:
        return None
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return default_principal(request)
