"""Token-protected HTML forms: a double submit lands on the first submit's result (PRG).

The form renders ``{% load idempotency %}{% idempotency_token %}``, a hidden
field holding a one-time token. The view, decorated with
:func:`idempotent_form` (or using :class:`IdempotentFormMixin`), consumes the
token when it runs. A second submit of the same token is answered with a
``303 See Other`` to the first submit's redirect target; while the first
submit is still running the second one waits for it (up to ``FORM_WAIT``
seconds). The view must answer a successful submit with a redirect: any other
answer (a form re-rendered with errors, a 4xx, a 5xx) gives the token back, so
the user can correct the form and submit again. Works without JavaScript.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from django.http import HttpRequest, HttpResponseBase, HttpResponseRedirect
from django.utils.html import format_html
from django.utils.safestring import SafeString

from idempotent_orders.exceptions import KeyInvalid
from idempotent_orders.http.decorators import FormRules, OnFailure, Policy, guard
from idempotent_orders.http.header import HEADER, parse_key
from idempotent_orders.http.replay import replay
from idempotent_orders.models import IdempotencyKey

__all__ = ["FORM_FIELD", "IdempotentFormMixin", "hidden_field", "idempotent_form"]

#: Name of the hidden form field carrying the token.
FORM_FIELD = "idempotency_token"
#: Fields left out of a form's fingerprint (they change between renders, not intent).
_VOLATILE_FIELDS = frozenset({"csrfmiddlewaretoken", FORM_FIELD})


def hidden_field(token: str) -> SafeString:
    return format_html('<input type="hidden" name="{}" value="{}">', FORM_FIELD, token)


def form_key(request: HttpRequest) -> str | None:
    raw = request.POST.get(FORM_FIELD)
    if raw is None:
        raw = request.headers.get(HEADER)
        return None if raw is None else parse_key(raw)
    if not raw:
        raise KeyInvalid(f"the form field {FORM_FIELD!r} is empty")
    return parse_key(raw)


def form_fingerprint(request: HttpRequest) -> str:
    """Method, path and the submitted fields (files by name and size), not the CSRF token."""
    digest = hashlib.sha256()
    digest.update(f"{request.method}\n{request.path}\n".encode())
    for name in sorted(request.POST):
        if name in _VOLATILE_FIELDS:
            continue
        for value in request.POST.getlist(name):
            digest.update(f"{name}={value}\n".encode("utf-8", "surrogateescape"))
    for name in sorted(request.FILES):
        for upload in request.FILES.getlist(name):
            digest.update(f"{name}@{upload.name}:{upload.size}\n".encode())
    return digest.hexdigest()


def redirect_to_result(row: IdempotencyKey) -> HttpResponseBase:
    """Post/redirect/get: send the second submit where the first one went."""
    location = next(
        (value for name, value in row.response_headers or [] if name.lower() == "location"), None
    )
    if location is None:
        return replay(row)
    response = HttpResponseRedirect(location, status=303)
    response["Idempotent-Replayed"] = "true"
    return response


#: A form's token is required; a second submit is answered with the first one's redirect.
FORM_POLICY = Policy(
    required=True, form=FormRules(fingerprint=form_fingerprint, redirect=redirect_to_result)
)


def idempotent_form(view: Any = None, *, on_failure: OnFailure | None = None) -> Any:
    """Decorate a view that handles a token-protected form (see the module docstring).

    ``on_failure`` as for :func:`~idempotent_orders.http.idempotent_view`: by default a
    ``def`` view runs in a transaction that a failure rolls back; ``"release"`` runs it
    outside one (a view that calls another system, such as a payment provider, and
    writes nothing itself), a failure giving the token back.
    ``@idempotent_form`` and ``@idempotent_form(on_failure="release")`` both work.
    """
    policy = FORM_POLICY if on_failure is None else replace(FORM_POLICY, on_failure=on_failure)
    if view is None:
        return lambda decorated: guard(decorated, policy, form_key)
    return guard(view, policy, form_key)


class IdempotentFormMixin:
    """Class-based-view mixin with the same behaviour as :func:`idempotent_form`."""

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        return guard(view, FORM_POLICY, form_key)
