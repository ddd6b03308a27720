"""drf-spectacular support (the ``spectacular`` extra): keyed operations in the schema.

Every POST, PUT, PATCH and DELETE operation of a view using
:class:`~idempotent_orders.contrib.drf.IdempotentAPIViewMixin` gets the
``Idempotency-Key`` header parameter, ``Idempotent-Replayed`` on its success
responses and the problem+json responses a key can answer (400, 403, 409, 413,
422, 429). Importing :mod:`idempotent_orders.contrib.drf` registers it when
drf-spectacular is installed.
"""

from __future__ import annotations

import copy
from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent

from idempotent_orders.http.keys import HEADER, UNSAFE_METHODS
from idempotent_orders.http.schema import KEY_PROBLEMS, PROBLEM, PROBLEM_SCHEMA, PROBLEM_TITLES

__all__ = ["IdempotentViewExtension"]


class _KeyedSchema:
    """Adds the key's parameter, header and problems to an unsafe method's operation."""

    def get_operation(self, *args: Any, **kwargs: Any) -> Any:
        operation = super().get_operation(*args, **kwargs)  # type: ignore[misc]
        schema: Any = self
        if operation is None or schema.method not in UNSAFE_METHODS:
            return operation
        problem = ResolvedComponent(
            name="IdempotencyProblem",
            type=ResolvedComponent.SCHEMA,
            object="IdempotencyProblem",
            schema=copy.deepcopy(PROBLEM_SCHEMA),
        )
        schema.registry.register_on_missing(problem)
        operation.setdefault("parameters", []).append(
            {
                "in": "header",
                "name": HEADER,
                "required": bool(getattr(schema.view, "idempotency_required", True)),
                "schema": {"type": "string", "minLength": 1, "maxLength": 257},
                "description": (
                    "Runs the operation at most once per key: a retry gets the stored "
                    "response (Idempotent-Replayed: true)."
                ),
            }
        )
        responses = operation.setdefault("responses", {})
        for status, response in responses.items():
            if str(status).startswith("2"):
                response.setdefault("headers", {})["Idempotent-Replayed"] = {
                    "schema": {"type": "string", "enum": ["true"]},
                    "description": "Present when this is the stored response, replayed.",
                }
        for status in KEY_PROBLEMS:
            responses.setdefault(
                str(status),
                {
                    "description": PROBLEM_TITLES[status],
                    "content": {PROBLEM: {"schema": problem.ref}},
                },
            )
        return operation


class IdempotentViewExtension(OpenApiViewExtension):
    """Describes the views that mix in ``IdempotentAPIViewMixin`` (their subclasses too)."""

    target_class = "idempotent_orders.contrib.drf.IdempotentAPIViewMixin"
    match_subclasses = True

    def view_replacement(self) -> Any:
        view: Any = self.target
        current = view.schema  # the view's own AutoSchema, or the default one
        base = type(current) if isinstance(current, AutoSchema) else AutoSchema
        keyed = type(f"Keyed{base.__name__}", (_KeyedSchema, base), {})
        return type(view.__name__, (view,), {"schema": keyed()})
