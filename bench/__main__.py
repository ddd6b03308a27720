"""``python -m bench``: every section in one run, one table (``-k name`` runs some)."""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time

from bench.common import Row, na, print_table, setup

SECTIONS = ["consumer", "workers", "http", "naive", "celery_once_peer", "memory", "outbox"]


def main(argv: list[str]) -> None:
    chosen = [s for s in SECTIONS if not argv[1:] or s in argv[1:]]
    setup()
    rows: list[Row] = []
    start = time.monotonic()
    for name in chosen:
        t0 = time.monotonic()
        try:
            rows += importlib.import_module(f"bench.{name}").run()
        except Exception as exc:  # a section that cannot run says why, the others go on
            rows.append(na(name, "section failed", repr(exc)[:100]))
        print(f"[bench] {name}: {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    print(
        f"\nidempotent_orders benchmarks, {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL; medians of "
        f"{os.environ.get('BENCH_RUNS', '3')} runs; {time.monotonic() - start:.0f}s\n"
    )
    print_table(rows)


if __name__ == "__main__":
    main(sys.argv)
