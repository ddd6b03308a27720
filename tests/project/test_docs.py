"""The documentation agrees with the code: generated references, page markers, setting names."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from idempotent_orders.checks import setting_type
from idempotent_orders.conf import DEFAULTS
from idempotent_orders.webhooks.config import KEYS as WEBHOOK_KEYS
from tests.support import docs_examples

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHECKS_SOURCES = sorted((ROOT / "idempotent_orders" / "checks").glob("*.py"))


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_gen_{name}", DOCS / "gen" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


hooks = _load("hooks")
reference = hooks._reference()

#: UPPER_SNAKE names the pages may show in code that are not keys of IDEMPOTENT_ORDERS,
#: each for a reason. A new name fails the test until it is added here or to DEFAULTS.
KNOWN_NAMES = {
    # The app's own Django settings.
    "IDEMPOTENT_ORDERS",
    "IDEMPOTENT_ORDERS_ORDER_MODEL",
    # conf.py's constant holding that name (shown in the check table's E041 message).
    "ORDER_MODEL_SETTING",
    # checks/metrics.py's shortest bearer token (shown in E090's message).
    "MIN_TOKEN_LENGTH",
    # Django settings and environment.
    "ATOMIC_REQUESTS",
    "AUTH_USER_MODEL",
    "CONN_MAX_AGE",
    "DISABLE_SERVER_SIDE_CURSORS",
    "DJANGO_SETTINGS_MODULE",
    "INSTALLED_APPS",
    "SILENCED_SYSTEM_CHECKS",
    # A cache's keys in CACHES (Django's, and django-redis's OPTIONS).
    "CLIENT_CLASS",
    "CONNECTION_FACTORY",
    "KEY_PREFIX",
    "PASSWORD",
    "REDIS_CLIENT_KWARGS",
    "SENTINELS",
    "SENTINEL_KWARGS",
    "SOCKET_CONNECT_TIMEOUT",
    "SOCKET_TIMEOUT",
    # Celery settings, as a Django project spells them (namespace "CELERY").
    "CELERY_BEAT_SCHEDULE",
    "CELERY_BROKER_URL",
    "CELERY_DB_REUSE_MAX",
    "CELERY_TASK_ACKS_LATE",
    "CELERY_TASK_REJECT_ON_WORKER_LOST",
    "CELERY_TASK_DEFAULT_QUEUE_TYPE",
    "CELERY_TASK_DEFAULT_EXCHANGE_TYPE",
    "CELERY_BROKER_TRANSPORT_OPTIONS",
    "CELERY_BROKER_NATIVE_DELAYED_DELIVERY_QUEUE_TYPE",
    "CELERY_WORKER_DETECT_QUORUM_QUEUES",
    # prometheus-client's multiprocess directory (an environment variable).
    "PROMETHEUS_MULTIPROC_DIR",
    "CELERY_WORKER_PREFETCH_MULTIPLIER",
    # django-fsm-2's names, in the own-model page.
    "ANY_OTHER_STATE",
    "ANY_STATE",
    "GET_STATE",
    "RETURN_VALUE",
    # The demo's environment variables (demo_project/settings.py).
    "DATABASE_URL",
    "REDIS_URL",
    # Make variables, WSGI request keys, SQL, test-suite constants.
    "DEMO_ARGS",
    "DEMO_WEB_ADDR",
    "DEMO_PAYMENT_TIMEOUT",
    "HTTP_HOST",
    "HTTP_IDEMPOTENCY_KEY",
    "REMOTE_ADDR",
    "GET_LOCK",
    "CRASH_POINTS",
}
# The keys of one webhook provider's dict in WEBHOOKS.
KNOWN_NAMES |= WEBHOOK_KEYS
#: Environment variables of the benchmark, the chaos run and the test suite.
KNOWN_PREFIXES = ("BENCH_", "CHAOS_", "IO_")

UPPER_SNAKE = re.compile(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
CHECK_ID = re.compile(r"\b[EW]0\d\d\b")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "gen" not in p.relative_to(DOCS).parts)


def rendered(path: Path) -> str:
    """The page's Markdown with its generated parts filled in, as the build does."""
    hooks.on_config({})
    return hooks.on_page_markdown(path.read_text(), page=None, config=None, files=None)


def unknown_setting_names(text: str) -> set[str]:
    names: set[str] = set()
    for span in CODE.findall(text):
        names.update(UPPER_SNAKE.findall(span))
    return {
        n
        for n in names
        if n not in DEFAULTS and n not in KNOWN_NAMES and not n.startswith(KNOWN_PREFIXES)
    }


def source_check_ids() -> set[str]:
    """Check IDs as the checks package spells them, found without the generator's parser."""
    source = "\n".join(path.read_text() for path in CHECKS_SOURCES)
    found = re.findall(r"""id=["']idempotent_orders\.([EW]\d{3})["']""", source)
    return set(found)


def test_settings_reference_has_every_default_with_its_value() -> None:
    docs = reference.settings_docs()
    assert [d.name for d in docs] == list(DEFAULTS)
    for d in docs:
        assert d.value == DEFAULTS[d.name], d.name
        assert d.comment or d.described_by, f"{d.name} has no description"
        assert d.type == setting_type(d.name).__name__ or d.type.startswith(("list[", "dict[")), (
            d.name
        )
    assert {d.name: d.type for d in docs}["LEASE_SECONDS"] == "float"
    table = reference.settings_table(docs)
    for name in DEFAULTS:
        assert f">{name}</code>" in table, name
    assert table.count("\n| <code") == len(DEFAULTS)


def test_settings_reference_takes_the_comment_above_the_key() -> None:
    by_name = {d.name: d for d in reference.settings_docs()}
    assert by_name["DEDUP_REDIS_RETRY_AFTER"].comment == (
        "After a Redis error, go straight to the database for this many seconds."
    )
    assert by_name["DEDUP_RETENTION"].default == "7 * 24 * 3600"
    # A key without a comment of its own points at the one it is listed under.
    assert by_name["TASK_RETRY_BACKOFF_MAX"].comment == ""
    assert by_name["TASK_RETRY_BACKOFF_MAX"].described_by == "TASK_MAX_RETRIES"


def test_check_reference_has_every_check_id() -> None:
    ids = source_check_ids()
    assert len(ids) > 20
    docs = reference.checks_docs()
    assert {d.id for d in docs} == ids
    table = reference.checks_table(docs)
    for ident in ids:
        assert f">{ident}</code>" in table, ident
    by_id = {d.id: d for d in docs}
    assert by_id["W031"].level == "Warning"
    assert by_id["E030"].plain_message.startswith(
        "DEDUP_RETENTION ({conf.DEDUP_RETENTION}s) is not longer than"
    )


def test_reference_pages_carry_their_generated_parts() -> None:
    assert "<!-- gen:settings -->" in (DOCS / "reference" / "settings.md").read_text()
    assert "<!-- gen:checks -->" in (DOCS / "reference" / "checks.md").read_text()
    own = rendered(DOCS / "own-order-model.md")
    assert "<!-- gen:" not in own
    assert "pending_payment --> paid: pay" in own
    assert "picking --> packed: pack" in own
    assert ">LEASE_SECONDS</code>" in rendered(DOCS / "reference" / "settings.md")
    assert ">E080</code>" in rendered(DOCS / "reference" / "checks.md")
    operations = rendered(DOCS / "operations.md")
    assert "| `manage.py idempotent_orders_stats` | Show how many messages" in operations
    assert "| `manage.py reconcile_orders` |" in operations


def test_the_generated_parts_written_in_the_pages_are_fresh() -> None:
    """A reader of the repository sees the tables the code generates now."""
    hooks.on_config({})
    assert [str(p.relative_to(ROOT)) for p in hooks.stale()] == [], "run make docs-gen"
    for name in ("settings", "checks"):
        text = (DOCS / "reference" / f"{name}.md").read_text()
        assert f"<!-- gen:{name} -->\n| " in text
        assert f"<!-- /gen:{name} -->" in text
    written = (DOCS / "reference" / "checks.md").read_text()
    assert ">E004</code>" in written


def test_a_stale_written_part_is_found_and_rewritten() -> None:
    hooks.on_config({})
    page = "intro\n<!-- gen:checks -->\n| an old table |\n<!-- /gen:checks -->\nafter\n"
    fresh = hooks.written(page)
    assert fresh != page
    assert "| an old table |" not in fresh
    assert fresh.startswith("intro\n<!-- gen:checks -->\n| ID | level |")
    assert fresh.endswith("<!-- /gen:checks -->\nafter\n")
    assert hooks.written(fresh) == fresh
    # The build shows the part without its marker lines.
    built = hooks.on_page_markdown(fresh, page=None, config=None, files=None)
    assert "gen:" not in built
    assert built.startswith("intro\n| ID | level |")
    assert built.endswith("|\nafter\n")


#: The test modules that run the pages' examples (``run("name", ...)`` and the like).
EXAMPLE_RUNNERS = sorted(ROOT.glob("tests/*/test_docs_examples.py"))


def examples_run() -> set[str]:
    """The strings of the runner modules: the names they run (``run("name", ...)``, a
    parametrized list of names)."""
    return {
        node.value
        for path in EXAMPLE_RUNNERS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@pytest.mark.parametrize("path", docs_examples.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_runs_or_is_the_text_of_code_that_runs(path: Path) -> None:
    """Each python block is run by a test, is a region of a tested file, or is marked as a
    fragment (tests/support/docs_examples.py); each compiles as written."""
    ran = examples_run()
    for block in docs_examples.blocks(path):
        try:
            compile(block.code, block.where, "exec")
        except SyntaxError as exc:
            pytest.fail(f"{block.where}: {exc}")
        assert block.kind, (
            f"{block.where}: a python block neither run (<!-- example: name -->), included "
            "(<!-- gen:code path#region -->) nor marked <!-- fragment: why -->"
        )
        if block.kind == "run":
            assert block.name in ran, f"{block.where}: no test runs the example {block.name!r}"


def test_example_names_are_unique() -> None:
    names = [b.name for b in docs_examples.all_blocks() if b.kind == "run"]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_fragments_are_few() -> None:
    fragments = [b.where for b in docs_examples.all_blocks() if b.kind == "fragment"]
    assert len(fragments) <= 7, fragments


def test_a_block_without_a_marker_is_found() -> None:
    page = ROOT / "build" / "unmarked.md"
    text = "intro\n\n```python\nx = 1\n```\n\n<!-- fragment: one line -->\n```python\ny\n```\n"
    found = docs_examples.blocks_of(text, page)
    assert [(b.kind, b.name) for b in found] == [("", ""), ("fragment", "one line")]


def test_a_code_region_is_the_file_text_between_its_markers() -> None:
    hooks.on_config({})
    source = hooks.ROOT / "demo_project" / "apps.py"
    region = hooks.region("demo_project/apps.py#bindings")
    assert region.startswith('registry.register(\n    "payment.succeeded",')
    assert "--8<--" not in region
    assert "registry.register(" in source.read_text()
    with pytest.raises(ValueError, match="no region 'nonsense'"):
        hooks.region("demo_project/apps.py#nonsense")
    with pytest.raises(ValueError, match="names no file"):
        hooks.region("demo_project/nonsense.py")


def test_an_unknown_marker_fails_the_build() -> None:
    hooks.on_config({})
    with pytest.raises(ValueError, match="unknown generated part"):
        hooks.on_page_markdown("<!-- gen:nonsense -->\n", page=None, config=None, files=None)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_pages_name_only_settings_that_exist(path: Path) -> None:
    assert unknown_setting_names(rendered(path)) == set()


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_pages_name_only_check_ids_that_exist(path: Path) -> None:
    named = set(CHECK_ID.findall(rendered(path)))
    assert named - source_check_ids() == set()


def test_the_setting_guard_catches_names_that_do_not_exist() -> None:
    # Both were once documented in the README; neither is a setting.
    text = '| `DEDUP_LAYERS` | `["bloom", "redis"]` |\n```python\n"CACHE_ALIAS": "default"\n```'
    assert unknown_setting_names(text) == {"DEDUP_LAYERS", "CACHE_ALIAS"}
    assert unknown_setting_names("`DEDUP_CACHE_ALIAS` and `LOCK_CACHE`") == set()


README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_names_only_settings_and_checks_that_exist() -> None:
    text = README.read_text()
    assert unknown_setting_names(text) == set()
    assert set(CHECK_ID.findall(text)) - source_check_ids() == set()


def test_readme_links_point_at_files_that_exist() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if "://" not in t]
    assert targets, "the README links into the docs"
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_readme_is_a_landing_page_with_the_command_ci_runs() -> None:
    # The long form lives in docs/; the README stays short, and CI runs the test
    # command it tells a newcomer to run.
    text = README.read_text()
    assert len(text.splitlines()) <= 180
    assert "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
