"""Section 6: resident memory of a consuming process over a long run (it must stay flat)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import ROOT, Row, make_orders, payment, setup

#: Messages in the run; `make bench-long` sets the target size, 1,000,000 (about
#: 3 minutes on a quiet 2-core machine, too much for `make bench`'s budget).
MESSAGES = int(os.environ.get("BENCH_MEMORY_MESSAGES", "30000"))
CHUNK = 2000


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child() -> None:
    setup(fresh=False)
    from django.db import reset_queries

    from idempotent_orders import dedup
    from idempotent_orders.consuming.batch import consume_batch

    samples = []
    done = 0
    while done < MESSAGES:
        orders = make_orders(min(CHUNK, MESSAGES - done))
        consume_batch([payment(o, "mem-") for o in orders], consumer="memory")
        done += len(orders)
        reset_queries()
        samples.append(_rss_kib("VmRSS"))
    # The live Bloom buckets' bit arrays: the only structure that grows with messages.
    buckets = list(dedup.bloom._buckets.values())
    size = sum(b.size_in_bits for b in buckets) // 8

    def bloom() -> str:
        return f"{size}:{len(buckets)}"

    print(
        json.dumps(
            {
                "after_first": samples[0],
                "end": samples[-1],
                "peak": _rss_kib("VmHWM"),
                "bloom": bloom() if callable(bloom) else None,
            }
        )
    )


def run() -> list[Row]:
    setup()
    out = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--child"],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        check=True,
        timeout=max(900, MESSAGES // 250),
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    growth = r["end"] - r["after_first"]
    bloom = (
        "Bloom size n/a: fast path not wired yet"
        if r["bloom"] is None
        else "Bloom {:,.0f} KiB in {} bucket(s), fixed by DEDUP_BLOOM_CAPACITY".format(
            int(r["bloom"].split(":")[0]) / 1024, r["bloom"].split(":")[1]
        )
    )
    return [
        Row(
            "6 memory",
            f"peak RSS over {MESSAGES:,} msgs (batch loop)",
            f"{r['peak'] / 1024:,.0f} MiB",
            f"{growth / 1024:+.1f} MiB after the first {CHUNK:,}; {bloom}",
        )
    ]


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    else:
        from bench.common import print_table

        print_table(run())
