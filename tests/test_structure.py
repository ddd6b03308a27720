"""House rules: registration in ``ready()``, no import cycle in http/, one error-code style."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from idempotent_orders import exceptions, fulfilment, leases
from tests.support.services import ROOT

PACKAGE = ROOT / "idempotent_orders"


def test_the_app_registers_the_fulfilment_step_when_ready() -> None:
    assert leases.get_step(fulfilment.STEP.consumer) is fulfilment.STEP


def test_importing_the_modules_registers_no_step() -> None:
    # Django set up without the app's ready(): every module is importable and
    # nothing is registered by importing it.
    script = """
import django
from idempotent_orders.apps import IdempotentOrdersConfig

IdempotentOrdersConfig.ready = lambda self: None
django.setup()
from idempotent_orders import fulfilment, leases, reconcile, tasks  # noqa: F401

print(leases.get_step(fulfilment.STEP.consumer) is None)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def _imports(path: Path) -> set[str]:
    """The ``idempotent_orders.http`` modules ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "idempotent_orders.http."
        ):
            found.add(node.module.removeprefix("idempotent_orders.http."))
    return found


#: Known back edges, each a lazy import inside one function: the deprecated aliases in
#: keys.py (removed in 0.3), and the schema view serving the document that describes it.
ALLOWED_BACK_EDGES = {("keys", "decorators"), ("views", "schema")}


def test_http_modules_do_not_import_each_other_back() -> None:
    graph = {p.stem: _imports(p) for p in (PACKAGE / "http").glob("*.py")}
    assert "forms" not in graph["decorators"]  # forms.py builds on decorators.py, not both ways
    cycles = {
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a in graph.get(b, set())
        and (a, b) not in ALLOWED_BACK_EDGES
        and (b, a) not in ALLOWED_BACK_EDGES
    }
    assert cycles == set()


def test_error_codes_are_kebab_case() -> None:
    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    codes = {
        cls.__name__: cls.default_code
        for cls in subclasses(exceptions.IdempotentOrdersError)
        if cls.__module__ == exceptions.__name__
    }
    assert len(codes) > 15
    assert {
        name: code for name, code in codes.items() if not re.fullmatch(r"[a-z]+(-[a-z]+)*", code)
    } == {}


def test_one_function_sends_message_consumed() -> None:
    # Every path reports a decided message through engine.consumed(); a second
    # sender would drift from it (arguments, sender) as the copies once did.
    senders = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for _ in re.finditer(r"message_consumed\.send", path.read_text())
    ]
    assert senders == ["engine.py"]
