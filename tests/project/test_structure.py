"""House rules: registration in ``ready()``, no import cycle, one error-code style."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from idempotent_orders import exceptions, fulfilment, leases
from tests.support.services import ROOT

pytestmark = pytest.mark.same_everywhere

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


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports that never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (under ``root``) and the modules of ``package`` it
    imports: at the top or inside functions, absolute or relative, not for typing only.
    ``from a import b`` names module ``a.b`` if there is one, else ``a``."""
    modules: dict[str, Path] = {}
    for path in (root / package.replace(".", "/")).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if not _is_type_checking(child):
                yield child
                yield from walk(child)

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str | None] = set()
        for node in walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(module_of(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else module_of(base))
        graph[name] = {m for m in found if m is not None and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of two modules or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for dep in sorted(graph[module]):
            if dep not in index:
                visit(dep)
                low[module] = min(low[module], low[dep])
            elif dep in stack:
                low[module] = min(low[module], index[dep])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


@pytest.mark.parametrize("package", ["idempotent_orders", "bench"])
def test_no_module_imports_itself_back(package: str) -> None:
    # Lazy imports (inside a function) count: they only hide a circle until it bites.
    graph = import_graph(ROOT, package)
    cycles = {
        " <-> ".join(cycle): {m: sorted(graph[m] & set(cycle)) for m in cycle}
        for cycle in import_cycles(graph)
    }
    assert cycles == {}


#: (lower, upper): the upper module imports the lower one, and the lower one is given what
#: it needs or holds the shared piece, so it never imports the upper one back: not at the
#: top, not inside a function, not for typing only.
LAYERED = [
    ("idempotent_orders.stats", "idempotent_orders.dedup"),
    ("idempotent_orders.admin.order_actions", "idempotent_orders.admin.orders"),
    ("idempotent_orders.http.lease", "idempotent_orders.http.claims"),
]


def _imported_names(module: str) -> set[str]:
    """Every absolute dotted name ``module``'s file imports, ``TYPE_CHECKING`` included."""
    path = ROOT / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(("lower", "upper"), LAYERED, ids=[lower for lower, _ in LAYERED])
def test_a_lower_module_never_imports_the_upper_one_back(lower: str, upper: str) -> None:
    upward = _imported_names(upper)
    assert any(n == lower or n.startswith(f"{lower}.") for n in upward), "not layered"
    back = {n for n in _imported_names(lower) if n == upper or n.startswith(f"{upper}.")}
    assert back == set()


def test_the_import_graph_sees_lazy_relative_and_circular_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "import pkg.sub.b\n"
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.sub.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_forms_build_on_the_decorators() -> None:
    graph = import_graph(ROOT, "idempotent_orders")
    assert "idempotent_orders.http.decorators" in graph["idempotent_orders.http.forms"]
    assert "idempotent_orders.http.forms" not in graph["idempotent_orders.http.decorators"]


HTTP = "idempotent_orders.http"
#: Which module of ``http/`` may import which: the key's steps one concept to a module
#: (header, principals, quotas, lease, claim_sql, claims, replay), the decorators
#: running them around a view above them, and the public paths (``keys``, the
#: package) on top. A new module of ``http/`` gets its row here.
HTTP_IMPORTS: dict[str, set[str]] = {
    "header": set(),
    "principals": {"header"},
    "quotas": set(),
    "lease": set(),
    "claim_sql": {"quotas"},
    "claims": {"header", "principals", "quotas", "lease", "claim_sql"},
    "replay": set(),
    "tokens": {"header", "principals", "quotas"},
    "problems": set(),
    "decorators": {"header", "principals", "lease", "claims", "replay", "problems"},
    "forms": {"decorators", "header", "replay"},
    "schema": set(),
    "views": {"decorators", "header", "principals", "problems", "schema", "tokens"},
    "middleware": {"problems"},
    "urls": {"views"},
    "keys": {
        "header",
        "principals",
        "quotas",
        "lease",
        "claims",
        "replay",
        "decorators",
    },
    "": {"decorators", "forms"},
}


def test_the_http_modules_import_only_the_ones_below_them() -> None:
    graph = import_graph(ROOT, "idempotent_orders")
    modules = {m.removeprefix(HTTP).removeprefix(".") for m in graph if m.startswith(HTTP)}
    assert modules == set(HTTP_IMPORTS), "HTTP_IMPORTS names every module of http/"
    wrong = {}
    for name, allowed in HTTP_IMPORTS.items():
        module = f"{HTTP}.{name}" if name else HTTP
        inside = {
            d.removeprefix(HTTP).removeprefix(".") for d in graph[module] if d.startswith(HTTP)
        }
        if inside - allowed:
            wrong[module] = sorted(inside - allowed)
    assert wrong == {}


def test_the_key_steps_stay_small() -> None:
    # One concept to a module: a step module past 600 lines holds two.
    long = {
        name: lines
        for name in HTTP_IMPORTS
        if name and (lines := len((PACKAGE / "http" / f"{name}.py").read_text().splitlines())) > 600
    }
    assert long == {}


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
    # Every path reports a decided message through consuming.decision.consumed(); a second
    # sender would drift from it (arguments, sender) as the copies once did.
    senders = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        for _ in re.finditer(r"message_consumed\.send", path.read_text())
    ]
    assert senders == ["consuming/decision.py"]


PREPARED = "idempotent_orders.prepared"


def test_one_module_owns_the_prepared_statements() -> None:
    # The consume roads and the HTTP claim share it; it imports neither (nor anything of the
    # package), and no other module writes PREPARE, DEALLOCATE or their SQLSTATEs.
    graph = import_graph(ROOT, "idempotent_orders")
    users = {m for m, deps in graph.items() if PREPARED in deps}
    assert {
        "idempotent_orders.http.claim_sql",
        "idempotent_orders.consuming.backends.postgresql.one_statement",
        "idempotent_orders.consuming.backends.postgresql.texts",
    } <= users
    assert graph[PREPARED] == set()
    writers = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"PREPARE |DEALLOCATE|42P05|26000", path.read_text())
    )
    assert writers == ["prepared.py"]


CONSUMING = "idempotent_orders.consuming"
#: What the consume road may not reach: the app's outer rooms build on it, not under it.
OUTER = {
    "idempotent_orders.admin",
    "idempotent_orders.contrib",
    "idempotent_orders.fulfilment",
    "idempotent_orders.http",
    "idempotent_orders.idempotent",
    "idempotent_orders.leases",
    "idempotent_orders.outbox",
    "idempotent_orders.reconcile",
    "idempotent_orders.tasks",
    "idempotent_orders.timers",
    "idempotent_orders.webhooks",
}


def test_the_consume_road_goes_down_its_layers_and_never_out() -> None:
    from idempotent_orders.consuming import LAYERS

    graph = import_graph(ROOT, "idempotent_orders")
    road = {m for m in graph if m.startswith(f"{CONSUMING}.")}
    assert road == {f"{CONSUMING}.{name}" for name in LAYERS}, "LAYERS names every module"
    wrong = {}
    for position, name in enumerate(LAYERS):
        module = f"{CONSUMING}.{name}"
        above = {f"{CONSUMING}.{later}" for later in LAYERS[position:]}
        outer = {d for d in graph[module] if any(d == o or d.startswith(f"{o}.") for o in OUTER)}
        if graph[module] & above or outer:
            wrong[module] = sorted((graph[module] & above) | outer)
    assert wrong == {}


OUTBOX = "idempotent_orders.outbox"


def test_the_outbox_goes_down_its_layers_and_never_out() -> None:
    # Each module imports only the ones before it in LAYERS (sibling names are looked up
    # on the sibling module: ``sender._send``), never the package itself (its __init__
    # imports them all), the consume road or the rooms built on the outbox.
    from idempotent_orders.outbox import LAYERS

    graph = import_graph(ROOT, "idempotent_orders")
    modules = {m for m in graph if m.startswith(f"{OUTBOX}.")}
    assert modules == {f"{OUTBOX}.{name}" for name in LAYERS}, "LAYERS names every module"
    outer = (OUTER - {OUTBOX}) | {CONSUMING}
    wrong = {}
    for position, name in enumerate(LAYERS):
        module = f"{OUTBOX}.{name}"
        above = {OUTBOX} | {f"{OUTBOX}.{later}" for later in LAYERS[position:]}
        out = {d for d in graph[module] if any(d == o or d.startswith(f"{o}.") for o in outer)}
        if graph[module] & above or out:
            wrong[module] = sorted((graph[module] & above) | out)
    assert wrong == {}


def test_the_outbox_package_names_its_modules_own_objects() -> None:
    # A module-level object exists once: the package's name is the module's object, so
    # ``outbox.breaker.reset()`` resets the breaker the relay trips.
    import importlib

    from idempotent_orders import exceptions, outbox

    defined = {}
    for name in outbox.LAYERS:
        module = importlib.import_module(f"{OUTBOX}.{name}")
        defined.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
    defined["PermanentPublishError"] = exceptions.PermanentPublishError
    assert [name for name in outbox.__all__ if getattr(outbox, name) is not defined.get(name)] == []
    assert outbox.breaker is importlib.import_module(f"{OUTBOX}.failures").breaker
    assert outbox.publisher is importlib.import_module(f"{OUTBOX}.thread").publisher


def test_no_outbox_module_is_over_600_lines() -> None:
    lengths = {
        path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "outbox").glob("*.py")
    }
    assert {name: n for name, n in lengths.items() if n > 600} == {}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def test_no_private_name_is_imported_across_packages() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith("idempotent_orders"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and _package(node.module) != _package(module):
                    found.append(f"{module} imports {node.module}.{alias.name}")
    assert found == []


ADMIN = "idempotent_orders.admin"
#: The admin package's modules and those of its siblings each may import: the dashboard
#: at the bottom (what needs attention, said after every action), what the lists share
#: on it, each list's module on those; the order admin on its actions, never the other
#: way (``order_actions`` names the mixin for typing only). The package imports them all.
ADMIN_IMPORTS: dict[str, set[str]] = {
    "dashboard": set(),
    "common": {"dashboard"},
    "order_actions": {"common", "dashboard"},
    "orders": {"common", "order_actions"},
    "inbox": {"common", "dashboard"},
    "evidence": {"common", "dashboard"},
    "outbox": {"common"},
    "keys": {"common"},
}


def test_the_admin_package_goes_down_its_layers() -> None:
    graph = import_graph(ROOT, "idempotent_orders")
    modules = {m for m in graph if m.startswith(f"{ADMIN}.")}
    assert modules == {f"{ADMIN}.{name}" for name in ADMIN_IMPORTS}, "the table names every module"
    wrong = {}
    for name, allowed in ADMIN_IMPORTS.items():
        inside = {
            d.removeprefix(f"{ADMIN}.")
            for d in graph[f"{ADMIN}.{name}"]
            if d == ADMIN or d.startswith(f"{ADMIN}.")
        }
        if inside - allowed:
            wrong[name] = sorted(inside - allowed)
    assert wrong == {}
    # Django's autodiscovery imports the package: it must import every module (registration).
    assert graph[ADMIN] == modules


def test_make_help_names_every_target() -> None:
    # A target a newcomer cannot find in `make help` does not exist for them.
    texts = [ROOT / "Makefile", *sorted((ROOT / "make").glob("*.mk"))]
    targets = {
        match.group(1)
        for path in texts
        for match in re.finditer(r"^([a-z][a-z0-9-]*):(?!=)", path.read_text(), re.MULTILINE)
    }
    shown = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    named = set(re.findall(r"^make ([a-z][a-z0-9-]*)", shown, re.MULTILINE))
    assert {"test", "demo", "bench", "chaos"} <= targets
    assert targets - {"help"} <= named, f"make help does not name {sorted(targets - named)}"


VENDORS = "idempotent_orders.vendors"


def test_only_the_vendors_room_asks_which_database_it_is() -> None:
    # A room asks vendors.vendor() what its database does; the vendor is read from the
    # connection in one place. The migration is exempt: it stays as it was written.
    readers = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts
        and re.search(r"\.vendor\b", path.read_text())
        and not path.relative_to(PACKAGE).as_posix().startswith("vendors/")
    )
    assert readers == []


def test_the_vendors_room_stands_below_every_other() -> None:
    graph = import_graph(ROOT, "idempotent_orders")
    room = {m for m in graph if m == VENDORS or m.startswith(f"{VENDORS}.")}
    assert room >= {f"{VENDORS}.postgresql", f"{VENDORS}.mysql", f"{VENDORS}.sqlite"}
    assert {m: sorted(graph[m] - room) for m in room if graph[m] - room} == {}
    users = {m for m, deps in graph.items() if deps & room and m not in room}
    assert {
        "idempotent_orders.consuming.backends",
        "idempotent_orders.http.claim_sql",
        "idempotent_orders.outbox.relay",
        "idempotent_orders.paginators",
    } <= users
