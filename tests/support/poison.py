"""A ``post_transition`` receiver with a bug, for the failure-path worker test.

Imported by test workers (``CELERY_IMPORTS``). Connected only where
``IO_POISON_SWITCH`` names a file, and it raises only for orders whose business
key starts with ``poison-`` while that file says ``broken``: the test fixes the
bug by rewriting the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django_fsm.signals import post_transition


def buggy_receiver(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
    switch = os.environ.get("IO_POISON_SWITCH", "")
    if not str(getattr(instance, "business_key", "")).startswith("poison-"):
        return
    if Path(switch).read_text().strip() == "broken":
        raise ZeroDivisionError("a bug in a receiver")


if os.environ.get("IO_POISON_SWITCH"):
    post_transition.connect(buggy_receiver, dispatch_uid="tests.support.poison")
