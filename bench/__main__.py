"""``python -m bench``: every section in one run, one table (``python -m bench consumer http``
runs some). Each run is appended to ``build/bench/results.jsonl``; ``--chart`` also
writes ``docs/img/benchmarks.png`` (each figure beside its baseline) and, when the
scale-out section ran, ``docs/img/scale_out.png`` (its curve).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time

from bench.common import Row, chart, na, print_table, record, setup

SECTIONS = [
    "consumer",
    "vendors",
    "workers",
    "batch_worker",
    "http",
    "http_server",
    "naive",
    "celery_once_peer",
    "memory",
    "outbox",
    "scale_out",
]


def main(argv: list[str]) -> None:
    flags = {a for a in argv[1:] if a.startswith("--")}
    names = [a for a in argv[1:] if not a.startswith("--")]
    unknown = [a for a in names if a not in SECTIONS] + sorted(flags - {"--chart"})
    if unknown or {"-h"} & set(argv[1:]):
        if unknown and "--help" not in unknown:
            print(f"unknown: {' '.join(unknown)}", file=sys.stderr)
        print(
            f"usage: python -m bench [--chart] [SECTION ...]\nsections: {' '.join(SECTIONS)}",
            file=sys.stderr,
        )
        sys.exit(0 if unknown in ([], ["--help"]) else 2)
    chosen = [s for s in SECTIONS if not names or s in names]
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
    elapsed = time.monotonic() - start
    title = (
        f"idempotent_orders benchmarks, {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, PostgreSQL; medians of "
        f"{os.environ.get('BENCH_RUNS', '3')} runs; {elapsed:.0f}s"
    )
    print(f"\n{title}\n")
    from bench.common import round_trips

    trips = round_trips()
    said = "; ".join(
        f"{name} {idle:.0f} us from idle, {sustained:.0f} us sustained"
        for name, (idle, sustained) in trips.items()
    )
    print(f"one round trip here, p50: {said}")
    from django.conf import settings

    from bench.consumer import default_configuration, differences

    loaded = ", ".join(differences(settings.IDEMPOTENT_ORDERS)) or "none"
    print(f"settings not at the app's defaults, as the bench loads them: {loaded}")
    reset = ", ".join(differences(default_configuration())) or "none"
    print(f"section 1's default-configuration rows put every other back; left: {reset}\n")
    print_table(rows)
    meta = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sections": chosen,
        "runs": int(os.environ.get("BENCH_RUNS", "3")),
        "seconds": round(elapsed),
        "load": os.getloadavg()[0],
        "round_trips_us": {name: [round(v) for v in pair] for name, pair in trips.items()},
    }
    print(f"\nappended to {record(rows, meta)}", file=sys.stderr)
    if "--chart" in flags:
        # The scale-out rows are a curve of their own, not a figure beside a baseline.
        others = [r for r in rows if not r.section.startswith("8 ")]
        if others:
            print(f"chart: {chart(others, title)}", file=sys.stderr)
        if "scale_out" in chosen:
            from bench.scale_out import chart as scale_chart

            scale_title = (
                f"scale-out, {time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores, "
                f"load {meta['load']:.1f}; one measurement per worker count"
            )
            print(f"scale-out chart: {scale_chart(rows, scale_title)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
