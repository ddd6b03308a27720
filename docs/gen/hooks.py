"""The generated parts of the pages, written into the pages themselves and refreshed by the build.

A page asks for a generated part with a marker line, and carries the part, as last
generated, between it and its closing line (``<!-- /gen:checks -->``), so that a reader
of the repository sees it too:

- ``<!-- gen:settings -->``: the settings table, from ``idempotent_orders/conf.py``;
- ``<!-- gen:checks -->``: the system check table, from ``idempotent_orders/checks/``;
- ``<!-- gen:graph app_label.Model -->``: the model's state graph as Mermaid, by the
  ``idempotent_orders_graph`` management command's own function;
- ``<!-- gen:commands -->``: the app's management commands with their help text;
- ``<!-- gen:code path/to/file.py#name -->``: a python block with the region of that file
  between ``# --8<-- [start:name]`` and ``# --8<-- [end:name]`` (dedented), or the whole
  file without ``#name``: the code a page shows is the code a test runs. (Put such a part
  between ``<!-- fmt: off -->`` and ``<!-- fmt: on -->``: it is formatted as its file is.)

An unknown marker fails the build. ``python docs/gen/hooks.py`` (``make docs-gen``)
writes every part into its page; ``--check`` only lists the stale pages (and
tests/project/test_docs.py fails on one). The MkDocs build fills each part afresh.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs"
#: A marker line, then (once written) the part and the closing line.
MARKER = re.compile(
    r"^<!-- gen:(?P<kind>[a-z]+)(?: (?P<arg>\S+))? -->(?:\n|$)"
    r"(?:(?P<body>.*?)^<!-- /gen:(?P=kind) -->(?:\n|$))?",
    re.MULTILINE | re.DOTALL,
)


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


#: The lines around a region of a source file that a page shows (pymdownx.snippets' spelling).
REGION = re.compile(r"^[ \t]*# --8<-- \[(?P<end>start|end):(?P<name>[a-z0-9_-]+)\][ \t]*$")


def region(arg: str) -> str:
    """The text of ``path#name`` (a region) or ``path`` (the whole file), dedented."""
    path, _, name = arg.partition("#")
    source = ROOT / path
    if not source.is_file():
        raise ValueError(f"gen:code names no file of the repository: {path}")
    lines = source.read_text().splitlines(keepends=True)
    if not name:
        return "".join(line for line in lines if not REGION.match(line)).strip("\n") + "\n"
    found: list[str] = []
    inside = False
    for line in lines:
        marker = REGION.match(line)
        if marker and marker["name"] == name:
            if marker["end"] == "start":
                inside = True
                continue
            if inside:
                return textwrap.dedent("".join(found)).strip("\n") + "\n"
        elif inside and not marker:
            found.append(line)
    raise ValueError(f"gen:code: no region {name!r} (start and end) in {path}")


def _code(arg: str | None) -> str:
    if arg is None:
        raise ValueError("gen:code names no file")
    return "```python\n" + region(arg) + "```\n"


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
    if kind == "code":
        return _code(arg)
    raise ValueError(f"unknown generated part: {match.group(0)}")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page with each generated part made afresh, its marker lines left out."""
    return MARKER.sub(_replace, markdown)


def written(markdown: str) -> str:
    """The page with each generated part made afresh between its marker lines."""

    def block(match: re.Match[str]) -> str:
        opening = match.group(0).split("\n", 1)[0]
        return f"{opening}\n{_replace(match)}<!-- /gen:{match['kind']} -->\n"

    return MARKER.sub(block, markdown)


def pages() -> list[Path]:
    """Every page of the site (the generators' folder is none)."""
    return sorted(p for p in DOCS.rglob("*.md") if "gen" not in p.relative_to(DOCS).parts)


def stale() -> list[Path]:
    """The pages whose written parts differ from what the code generates now."""
    return [p for p in pages() if written(p.read_text()) != p.read_text()]


def main(argv: list[str]) -> int:
    on_config({})
    found = stale()
    if "--check" in argv:
        for path in found:
            print(f"{path.relative_to(ROOT)}: generated parts are stale (make docs-gen)")
        return 1 if found else 0
    for path in found:
        path.write_text(written(path.read_text()))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
