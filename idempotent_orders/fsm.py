"""The django-fsm-2 names the app builds on, imported in one place.

django-fsm-2 and the archived ``django-fsm`` (2.8.x, and 3.x which only warns that it
moved) both install the module ``django_fsm``; pip installs them side by side without a
word, and whichever was installed last wins. Where the archived one wins, importing
this module says so and how to mend it, instead of an ``ImportError`` about a name.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

#: What a project meets when the archived package shadows django-fsm-2.
SHADOWED = (
    "idempotent_orders needs django-fsm-2, but the module django_fsm installed here is "
    "another ({detail}): the archived django-fsm package, installed over django-fsm-2 or "
    "beside it (both install django_fsm). Remove both and reinstall django-fsm-2: "
    "pip uninstall -y django-fsm django-fsm-2 && pip install django-fsm-2"
)

try:
    from django_fsm import (
        ANY_OTHER_STATE,
        ANY_STATE,
        FSMField,
        FSMFieldMixin,
        FSMModelMixin,
        State,
        transition,
    )
except ImportError as exc:  # exercised in a subprocess by tests/test_checks.py
    raise ImproperlyConfigured(SHADOWED.format(detail=exc)) from exc

__all__ = [
    "ANY_OTHER_STATE",
    "ANY_STATE",
    "FSMField",
    "FSMFieldMixin",
    "FSMModelMixin",
    "State",
    "transition",
]
