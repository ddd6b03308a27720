"""Which index serves each inbox query at size: ``EXPLAIN (ANALYZE, BUFFERS)`` of the SQL
the app's own code sends (admin pages, dashboard, reconciler, purge, Bloom warm-up).

    BENCH_KEEP=1 ... bench/at_size.py            # a filled database, kept
    IO_TEST_NAMESPACE=<ns> .venv/bin/python bench/at_size_plans.py [-v] [name ...]

Runs on ``size_<ns>`` (``BENCH_DB``), the database ``bench/at_size.py`` fills. Each
SELECT on the inbox is printed with the indexes its plan uses and its execution
time; ``-v`` prints whole plans. The purge runs inside a rolled-back transaction,
one batch each, with ``DEDUP_RETENTION`` set to cut-offs inside the filled 48 h.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DB = os.environ.get("BENCH_DB", f"size_{os.environ.get('IO_TEST_NAMESPACE', 'bench')}")
INBOX = "/admin/idempotent_orders/processedmessage/"
#: A plan's table and index reads, as EXPLAIN names them.
SCAN = re.compile(
    r"(Seq Scan on \w+|Index (?:Only )?Scan(?: Backward)? using \w+|Bitmap Index Scan on \w+)"
)


def cases() -> dict[str, Callable[[], Any]]:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import transaction
    from django.db.models import CharField, Value
    from django.db.models.functions import Concat
    from django.test import Client, override_settings
    from django.utils import timezone

    from idempotent_orders import leases, retention
    from idempotent_orders.models import ProcessedMessage

    users = get_user_model()._default_manager
    user = users.filter(username="bench-admin").first() or users.create_superuser(
        "bench-admin", "a@example.com", "x"
    )
    client = Client()
    client.force_login(user)
    first = ProcessedMessage.objects.order_by("id").values_list("message_id", "order_id").first()
    message_id, order_pk = first or ("none", 1)

    def page(query: str) -> Callable[[], Any]:
        return lambda: client.get(INBOX + query)

    def purge(hours: int) -> Callable[[], Any]:
        def one_batch(model: Any, condition: Any, size: int) -> int:
            # The SELECT of retention's first batch; the DELETE is not what is measured.
            return len(model._default_manager.filter(condition).order_by("pk")[:size])

        def run() -> None:
            values = {**settings.IDEMPOTENT_ORDERS, "DEDUP_RETENTION": hours * 3600}
            batches = retention._delete_in_batches
            retention._delete_in_batches = one_batch  # type: ignore[assignment]
            try:
                with override_settings(IDEMPOTENT_ORDERS=values), transaction.atomic():
                    retention.purge()
                    transaction.set_rollback(True)
            finally:
                retention._delete_in_batches = batches  # type: ignore[assignment]

        return run

    def bloom_bucket() -> Any:
        # dedup.bloom's query for one hourly bucket of the window (read through a
        # server-side cursor, which the captured queries do not show).
        lower = timezone.now() - timedelta(hours=5)
        rows = ProcessedMessage.objects.filter(
            created_at__gte=lower, created_at__lt=lower + timedelta(hours=1)
        ).annotate(key=Concat("consumer", Value("\x1f"), "message_id", output_field=CharField()))
        return rows.values_list("key", flat=True)

    return {
        "inbox list": page(""),
        "inbox page 50": page("?p=50"),
        "attention=stuck": page("?attention=stuck"),
        "attention=failed": page("?attention=failed"),
        "attention=dead": page("?attention=dead"),
        "attention=rejected_today": page("?attention=rejected_today"),
        "attention=refund": page("?attention=refund"),
        "outcome=applied": page("?outcome__exact=applied"),
        "outcome=parked": page("?outcome__exact=parked"),
        "outcome=rejected": page("?outcome__exact=rejected"),
        "status=processing": page("?status__exact=processing"),
        "status=done": page("?status__exact=done"),
        "search message id": page(f"?q={message_id}"),
        "search order id": page(f"?q={order_pk}"),
        "sort by created at": page("?o=-8"),
        "order change page (timeline)": lambda: client.get(
            f"/admin/idempotent_orders/order/{order_pk}/change/"
        ),
        "dashboard": lambda: client.get("/admin/"),
        "reconciler: expired leases": lambda: list(leases.expired()[:100]),
        "purge, 7 d (default; nothing due)": purge(7 * 24),
        "purge, 47 h (1/48 due)": purge(47),
        "purge, 24 h (half due)": purge(24),
        "Bloom warm-up, one bucket": bloom_bucket,
    }


def main(argv: list[str]) -> None:
    import django

    django.setup()
    from django.db import connection
    from django.db.models import QuerySet
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    setup_test_environment()
    verbose = "-v" in argv
    only = [a for a in argv if not a.startswith("-")]
    for name, call in cases().items():
        if only and not any(o in name for o in only):
            continue
        with CaptureQueriesContext(connection) as queries:
            returned = call()
        plans = []
        for sql in (q["sql"] for q in queries.captured_queries):
            if "processedmessage" in sql and sql.lstrip().upper().startswith("SELECT"):
                with connection.cursor() as cursor:
                    cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
                    plans.append((sql, [row[0] for row in cursor.fetchall()]))
        if isinstance(returned, QuerySet):
            plans.append((str(returned.query), returned.explain(analyze=True, buffers=True)))
        for sql, plan in plans:
            lines = plan.splitlines() if isinstance(plan, str) else plan
            used = sorted(set(SCAN.findall("\n".join(lines))))
            took = next((line.split(": ")[1] for line in lines if "Execution Time" in line), "")
            print(f"{name:36} {took:>12}  {'; '.join(used)}")
            if verbose:
                print(f"    {sql[:200]}")
                print("\n".join(f"    {line}" for line in lines))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--child"]:
        env = {
            **os.environ,
            "IO_TEST_DATABASE": "postgres",
            "IO_TEST_DB_NAME": DB,
            "IO_WORKER_DB": "1",
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
        }
        args = [sys.executable, __file__, "--child", *sys.argv[1:]]
        sys.exit(subprocess.run(args, env=env, cwd=ROOT, check=False).returncode)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench")]
    main(sys.argv[2:])
