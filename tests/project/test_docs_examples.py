"""The pages' python examples, run as written under the app's own order model.

Each test executes one block marked ``<!-- example: name -->`` (tests/support/docs_examples.py)
and asserts what the page says it does. What the block takes from the reader's project (a
model, a user, a message) is given in its namespace; nothing of the block is rewritten.
The own-model pages' examples run in tests/swapped/test_docs_examples.py.
"""

from __future__ import annotations

import ast
import sys
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from celery import current_app
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import RequestFactory, override_settings
from django.urls import resolve
from django.utils.module_loading import import_string

from demo_project.models import LoyaltyAccount
from idempotent_orders import get_order_model
from idempotent_orders.checks import setting_type
from idempotent_orders.checks.metrics import check_metrics_access
from idempotent_orders.conf import DEFAULTS
from idempotent_orders.models import OutboxMessage, ProcessedMessage, Timer
from idempotent_orders.webhooks.config import KEYS as WEBHOOK_KEYS
from idempotent_orders.webhooks.config import problems
from tests.support.docs_examples import evaluate, example, run
from tests.support.messages import payment


def results(name: str, namespace: dict[str, Any]) -> list[Any]:
    """Run the example statement by statement, as a shell would: the value of each bare
    expression, in order (the pages write what each shows in a comment beside it)."""
    block = example(name)
    tree = ast.parse(block.code)
    shown = []
    scope = {"__name__": f"docs_example_{name.replace('-', '_')}", **namespace}
    for statement in tree.body:
        if isinstance(statement, ast.Expr):
            code = compile(ast.Expression(statement.value), block.where, "eval")
            shown.append(eval(code, scope))
        else:
            exec(compile(ast.Module([statement], []), block.where, "exec"), scope)
    namespace.update(scope)
    return shown


def registered_task_names() -> set[str]:
    import idempotent_orders.tasks  # noqa: F401  (the app's tasks, as a worker imports them)

    return set(current_app.tasks)


def urlconf(patterns: list[Any]) -> types.ModuleType:
    module = types.ModuleType(f"docs_urls_{uuid.uuid4().hex}")
    module.urlpatterns = patterns  # type: ignore[attr-defined]
    return module


@pytest.fixture
def orders_of_the_app() -> None:
    if get_order_model()._meta.label != "idempotent_orders.Order":
        pytest.fail("these examples run on the app's own Order (tests.settings)")


# -- getting-started.md ------------------------------------------------------------------


def test_getting_started_settings() -> None:
    scope = run("settings", {"INSTALLED_APPS": ["django.contrib.auth"]})
    assert scope["INSTALLED_APPS"] == ["django.contrib.auth", "idempotent_orders"]
    assert set(scope["IDEMPOTENT_ORDERS"]) <= set(DEFAULTS)
    assert scope["IDEMPOTENT_ORDERS"]["DEDUP_RETENTION"] == DEFAULTS["DEDUP_RETENTION"]
    assert scope["CACHES"]["default"]["BACKEND"] == "django_redis.cache.RedisCache"
    tasks = {entry["task"] for entry in scope["CELERY_BEAT_SCHEDULE"].values()}
    assert tasks
    assert tasks <= registered_task_names()


def test_getting_started_celery_app() -> None:
    before = current_app._get_current_object()
    try:
        app = run("celery-app")["app"]
    finally:
        before.set_current()  # Celery(...) makes itself the current app
    assert app.main == "shop"
    # It reads the project's CELERY_* settings.
    assert app.conf.task_acks_late is settings.CELERY_TASK_ACKS_LATE is True
    assert app.conf.worker_prefetch_multiplier == 1


def test_getting_started_celery_init() -> None:
    from demo_project.celery import app

    scope = run(
        "celery-init", {"__name__": "demo_project.docs_init", "__package__": "demo_project"}
    )
    assert scope["celery_app"] is app
    assert scope["__all__"] == ("celery_app",)


@pytest.fixture
def shop_urls() -> Iterator[types.ModuleType]:
    module = urlconf(run("urls")["urlpatterns"])
    with override_settings(ROOT_URLCONF=module):
        yield module


@pytest.mark.django_db
def test_getting_started_urls(shop_urls: types.ModuleType) -> None:
    assert resolve("/api/orders/").url_name
    assert resolve("/admin/").app_name == "admin"


@pytest.mark.django_db
def test_getting_started_shell_publish_and_http(
    shop_urls: types.ModuleType, orders_of_the_app: None
) -> None:
    scope: dict[str, Any] = {}
    shown = results("shell", scope)
    applied, duplicate, refreshed, fields = shown
    assert (str(applied), str(duplicate), refreshed) == ("applied", "duplicate", None)
    assert fields == ("paid", 1, "PAY-1")

    # The message sent again through the app's task: the inbox says duplicate.
    eager = current_app.conf.task_always_eager
    current_app.conf.task_always_eager = True
    try:
        run("publish", {"message": scope["message"]})
    finally:
        current_app.conf.task_always_eager = eager
    row = ProcessedMessage.objects.get(consumer="payments", message_id="pay-1")
    assert row.outcome == "applied"
    scope["order"].refresh_from_db()
    assert scope["order"].version == 1

    logged_in, first, replayed, mismatch = results("http-client", {"ana": scope["ana"]})
    assert logged_in is None  # client.force_login(ana)
    assert first[0] == 201
    assert first[1]["status"] == "pending_payment"
    assert replayed == (201, "true")
    assert mismatch == (422, "key-mismatch")
    assert get_order_model().objects.filter(customer=scope["ana"]).count() == 2


# -- index.md and README.md ------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["index-quickstart", "readme-quickstart"])
def test_quickstart(name: str, make_order: Any, orders_of_the_app: None) -> None:
    order = make_order()
    message = payment(order)
    for _ in range(2):  # however often it arrives
        scope = run(name, {"message": message})
    assert scope["CELERY_TASK_ACKS_LATE"] is True
    assert "idempotent_orders" in scope["INSTALLED_APPS"]
    row = ProcessedMessage.objects.get(consumer="payments", message_id=message["message_id"])
    assert row.outcome == "applied"
    order.refresh_from_db()
    assert (order.status, order.version) == ("paid", 1)


# -- beyond-orders.md ------------------------------------------------------------------------


@pytest.fixture
def loyalty() -> dict[str, Any]:
    return run("loyalty-task", {"LoyaltyAccount": LoyaltyAccount})


@pytest.mark.django_db
def test_loyalty_task_awards_once(loyalty: dict[str, Any]) -> None:
    LoyaltyAccount.objects.create(customer="docs-ana")
    message = {"message_id": "docs-points-1", "customer": "docs-ana", "points": 42}
    task = loyalty["award_points"]
    answers = [task.apply(args=[message]).get() for _ in range(2)]
    assert answers == [{"awarded": 42}, {"awarded": 42}]
    assert LoyaltyAccount.objects.get(customer="docs-ana").points == 42


class Partner:
    """The partner's API: remembers the keys it was called with."""

    def __init__(self) -> None:
        self.posts: list[tuple[Any, str]] = []

    def post(self, data: Any, headers: dict[str, str]) -> None:
        self.posts.append((data, headers["Idempotency-Key"]))

    def has_request(self, key: str) -> bool:
        return any(seen == key for _, seen in self.posts)


@pytest.mark.django_db(transaction=True)
def test_partner_task_posts_once_with_its_key(loyalty: dict[str, Any]) -> None:
    partner = Partner()
    names = {"shared_task": loyalty["shared_task"], "idempotent": loyalty["idempotent"]}
    scope = run("partner-task", {**names, "partner": partner})
    message = {"message_id": "docs-partner-1", "data": {"order": 7}}
    answers = [scope["notify_partner"].apply(args=[message]).get() for _ in range(2)]
    assert answers == [{"notified": "docs-partner-1"}] * 2
    assert len(partner.posts) == 1
    assert partner.posts[0][0] == {"order": 7}
    assert partner.has_request(partner.posts[0][1])


@pytest.mark.django_db
def test_permanent_errors_are_dead_at_once(loyalty: dict[str, Any]) -> None:
    names = {"shared_task": loyalty["shared_task"], "idempotent": loyalty["idempotent"]}
    scope = run("permanent-errors", {**names, "Customer": get_user_model()})
    message = {"message_id": "docs-gone-1", "customer_id": 987654}
    result = scope["award_points"].apply(args=[message])
    assert result.state == "IGNORED"  # MessageDead: Celery neither retries nor fails it
    row = ProcessedMessage.objects.get(consumer="loyalty", message_id="docs-gone-1")
    assert row.attempts == 1
    assert row.dead_at is not None
    assert "DoesNotExist" in row.error


@pytest.mark.django_db
def test_fenced_lock_writes_with_its_token() -> None:
    customer = f"docs-{uuid.uuid4().hex[:8]}"
    LoyaltyAccount.objects.create(customer=customer)
    scope = run(
        "fenced-lock",
        {"LoyaltyAccount": LoyaltyAccount, "customer": customer, "compute_points": lambda c: 7},
    )
    assert scope["rows"] == 1
    account = LoyaltyAccount.objects.get(customer=customer)
    assert account.points == 7
    assert account.fence > 0  # the write carried the lock's fencing token


@pytest.mark.django_db
def test_publish_on_commit(
    monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    from demo_project.tasks import award_points

    sent: list[str] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: sent.append(kw["task_id"]))
    with django_capture_on_commit_callbacks(execute=True):
        scope = run("publish-on-commit", {"Order": get_order_model(), "award_points": award_points})
    message_id = f"order-points-{scope['order'].pk}"
    assert OutboxMessage.objects.filter(message_id=message_id).count() == 1
    assert sent == [message_id]


@pytest.mark.parametrize(
    "name", ["outbox-beat", "beat-schedule", "surface-parked-beat", "timers-beat"]
)
def test_beat_schedules_name_tasks_that_exist(name: str) -> None:
    schedule = run(name)["CELERY_BEAT_SCHEDULE"]
    tasks = {entry["task"] for entry in schedule.values()}
    assert tasks
    assert tasks <= registered_task_names()


# -- http.md ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_http_decorators() -> None:
    scope = run("http-decorators")
    request = RequestFactory().post("/payments/", {}, content_type="application/json")
    assert scope["create_payment"](request).status_code == 400  # no Idempotency-Key
    assert scope["IdempotentAPIViewMixin"].__module__ == "idempotent_orders.contrib.drf"


@pytest.mark.django_db
def test_create_order(orders_of_the_app: None) -> None:
    user = get_user_model().objects.create_user("docs-user")
    scope = run("create-order", {"user": user, "Decimal": Decimal})
    assert scope["created"] is True
    order = scope["order"]
    assert (order.customer, order.amount, order.status) == (
        user,
        Decimal("176.00"),
        "pending_payment",
    )


@pytest.mark.django_db
def test_django_tasks_task_runs_once_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import django.tasks  # noqa: F401  (Django 6)
    except ImportError:  # Django 5.2: the django-tasks backport, as the page says
        import django_tasks

        monkeypatch.setitem(sys.modules, "django.tasks", django_tasks)
    assert "db" in settings.TASKS, "the test settings have django-tasks-db's backend"
    task = run("django-tasks")["award_points"]
    assert task.backend == "db"
    message = {"message_id": "docs-task-1"}
    task.call(message)
    task.call(message)
    assert ProcessedMessage.objects.filter(consumer="loyalty.award").count() == 1


# -- operations.md ---------------------------------------------------------------------------


def test_redis_cluster_and_sentinel_caches() -> None:
    scope = run("redis-cluster")
    dedup = scope["CACHES"]["dedup"]
    assert import_string(dedup["OPTIONS"]["CONNECTION_FACTORY"]).__name__ == (
        "ClusterConnectionFactory"
    )
    assert "{" not in dedup["KEY_PREFIX"]
    assert set(scope["IDEMPOTENT_ORDERS"]) <= set(DEFAULTS)
    assert set(scope["IDEMPOTENT_ORDERS"].values()) <= set(scope["CACHES"])
    sentinel = run("redis-sentinel", {"CACHES": scope["CACHES"]})["CACHES"]["dedup"]
    assert import_string(sentinel["OPTIONS"]["CLIENT_CLASS"])
    assert import_string(sentinel["OPTIONS"]["CONNECTION_FACTORY"])


def test_metrics_token_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("METRICS_TOKEN", "a-scraper-token-of-32-characters")
    scope = run("metrics-token", {"os": os})
    with override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, **scope["IDEMPOTENT_ORDERS"]}
    ):
        assert check_metrics_access() == []
    monkeypatch.setenv("METRICS_TOKEN", "short")
    scope = run("metrics-token", {"os": os})
    with override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, **scope["IDEMPOTENT_ORDERS"]}
    ):
        assert [m.id for m in check_metrics_access()] == ["idempotent_orders.E090"]


def test_gunicorn_hook() -> None:
    from idempotent_orders.observability import gunicorn_child_exit

    assert run("gunicorn")["child_exit"] is gunicorn_child_exit


# -- reference/settings.md -------------------------------------------------------------------


def test_settings_reference_example() -> None:
    configured = run("settings-reference")["IDEMPOTENT_ORDERS"]
    assert set(configured) <= set(DEFAULTS)
    for key, value in configured.items():
        assert isinstance(value, setting_type(key)), key


# -- testing.md ------------------------------------------------------------------------------


def test_effect_context_manager_runs_the_call() -> None:
    from idempotent_orders.testing.effects import watch_effects

    captured: list[tuple[str, str]] = []
    gateway = types.SimpleNamespace(capture=lambda pid, amount: captured.append((pid, amount)))
    with watch_effects() as effects:
        run("effect", {"gateway": gateway, "payment_id": "ch_1", "amount": "4.00"})
    assert captured == [("ch_1", "4.00")]
    assert effects.count("gateway.capture") == Counter({(("payment_id", "ch_1"),): 1})


# -- webhooks-and-timers.md ------------------------------------------------------------------


def test_stripe_webhook_settings_and_urls() -> None:
    from django.urls import include, path

    scope = run("stripe-webhook", {"urlpatterns": [], "path": path, "include": include})
    [(name, provider)] = scope["IDEMPOTENT_ORDERS"]["WEBHOOKS"].items()
    assert problems(name, provider) == []
    assert callable(import_string(provider["TO_MESSAGE"]))
    with override_settings(ROOT_URLCONF=urlconf(scope["urlpatterns"])):
        assert resolve("/webhooks/stripe/").kwargs == {"provider": "stripe"}


def test_stripe_event_types() -> None:
    entry = evaluate("stripe-event-types")
    assert set(entry) <= WEBHOOK_KEYS
    assert problems("stripe", {"SCHEME": "stripe", "SECRET": "whsec_test", **entry}) == []
    assert callable(import_string(entry["TO_MESSAGE"]))


@pytest.mark.django_db
def test_schedule_timer(orders_of_the_app: None) -> None:
    scope = run("schedule-timer", {"Order": get_order_model()})
    timer = Timer.objects.get(order=scope["order"])
    assert (timer.transition, timer.status) == ("expire", "pending")
