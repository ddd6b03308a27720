"""MkDocs hooks: fill the generated parts of the pages from the code at build time.

A page asks for a generated part with a marker line:

- ``<!-- gen:settings -->``: the settings table, from ``idempotent_orders/conf.py``;
- ``<!-- gen:checks -->``: the system check table, from ``idempotent_orders/checks/``;
- ``<!-- gen:graph app_label.Model -->``: the model's state graph as Mermaid, by the
  ``idempotent_orders_graph`` management command's own function;
- ``<!-- gen:commands -->``: the app's management commands with their help text.

An unknown marker fails the build.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MARKER = re.compile(r"^<!-- gen:(?P<kind>[a-z]+)(?: (?P<arg>\S+))? -->$", re.MULTILINE)


def _setup_django() -> None:
    """Configure a minimal Django with the app and the demo's own order model installed."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "idempotent_orders",
            "demo_project",
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
    )
    django.setup()


def _reference() -> ModuleType:
    """``docs/gen/reference.py``, loaded by path (this folder is not a package)."""
    name = "idempotent_orders_docs_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "reference.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def on_config(config: Any) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the app and the demo project, from this checkout
    _setup_django()
    return config


def _graph(label: str | None) -> str:
    from idempotent_orders.management.commands.idempotent_orders_graph import (
        render,
        resolve_model,
    )

    return "```mermaid\n" + render(resolve_model(label), "mermaid") + "```\n"


def _commands() -> str:
    from django.core.management import find_commands, load_command_class

    import idempotent_orders

    folder = Path(idempotent_orders.__file__).parent / "management"
    rows = ["| command | what it does |", "|---|---|"]
    for name in sorted(find_commands(str(folder))):
        help_text = " ".join(str(load_command_class("idempotent_orders", name).help).split())
        rows.append(f"| `manage.py {name}` | " + help_text.replace("|", "\\|") + " |")
    return "\n".join(rows) + "\n"


def _replace(match: re.Match[str]) -> str:
    reference = _reference()
    kind, arg = match["kind"], match["arg"]
    if kind == "settings" and arg is None:
        return reference.settings_table()
    if kind == "checks" and arg is None:
        return reference.checks_table()
    if kind == "graph":
        return _graph(arg)
    if kind == "commands" and arg is None:
        return _commands()
    raise ValueError(f"unknown generated part: {match.group(0)}")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(_replace, markdown)
