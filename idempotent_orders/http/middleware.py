"""``ProblemMiddleware``: an idempotency error raised where no view can answer it (a
template tag minting a token while a page renders) becomes its problem+json answer."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase

from idempotent_orders.exceptions import IdempotencyError
from idempotent_orders.http.problems import problem_from

__all__ = ["ProblemMiddleware"]


class ProblemMiddleware:
    """Answer an :class:`~idempotent_orders.exceptions.IdempotencyError` raised by a view
    or while its response renders (``{% idempotency_token %}`` past ``SESSION_RATE``:
    429 ``too-many-sessions`` with ``Retry-After``) as a problem, not a 500."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return self.get_response(request)

    def process_exception(
        self, request: HttpRequest, exception: Exception
    ) -> HttpResponseBase | None:
        if isinstance(exception, IdempotencyError):
            return problem_from(exception)
        return None
