"""Bloom filter (rbloom, stable hash) against a bit array for dense integer ids.

Run: ``python bench/dedup_layers.py [N]``. Prints, side by side, the cost of an
add and of a lookup, memory and false-positive rate. The bit array only works
when ids are dense integers (seed 001): a bit per possible id.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable

from rbloom import Bloom


def stable_hash(item: str) -> int:
    digest = hashlib.blake2b(item.encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big", signed=True)


class BitArray:
    """One bit per integer id in [0, size)."""

    def __init__(self, size: int) -> None:
        self.bits = bytearray((size + 7) // 8)

    def add(self, n: int) -> None:
        self.bits[n >> 3] |= 1 << (n & 7)

    def __contains__(self, n: int) -> bool:
        return bool(self.bits[n >> 3] & (1 << (n & 7)))


def timed(label: str, fn: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    fn()
    per = (time.perf_counter() - start) / count * 1e9
    return per


def main(n: int) -> None:
    ids = list(range(1, n + 1))
    probes = list(range(n + 1, 2 * n + 1))  # never added
    keys = [f"payments\x1f{i}" for i in ids]
    probe_keys = [f"payments\x1f{i}" for i in probes]
    rows = []

    stable = Bloom(n, 0.001, stable_hash)
    add = timed("", lambda: [stable.add(k) for k in keys], n)
    hit = timed("", lambda: [k in stable for k in keys], n)
    fp = sum(k in stable for k in probe_keys) / n
    rows.append(("bloom rbloom+blake2b (ours)", add, hit, stable.size_in_bits / 8, fp))

    salted = Bloom(n, 0.001)
    add = timed("", lambda: [salted.add(k) for k in keys], n)
    hit = timed("", lambda: [k in salted for k in keys], n)
    fp = sum(k in salted for k in probe_keys) / n
    rows.append(("bloom rbloom builtin hash*", add, hit, salted.size_in_bits / 8, fp))

    bits = BitArray(2 * n + 1)
    add = timed("", lambda: [bits.add(i) for i in ids], n)
    hit = timed("", lambda: [i in bits for i in ids], n)
    bits_small = BitArray(n + 1)
    fp = 0.0
    rows.append(("bit array (dense ints)", add, hit, len(bits_small.bits), fp))

    print(f"N = {n:,} ids, error rate 0.001 for the Bloom filters")
    print(f"{'layer':<30} {'add ns':>8} {'lookup ns':>10} {'bytes':>12} {'false +':>9}")
    for name, add, hit, size, fp in rows:
        print(f"{name:<30} {add:>8.0f} {hit:>10.0f} {size:>12,.0f} {fp:>9.4%}")
    print("* salted per process: cannot be rebuilt or compared across processes")
    redis_roundtrip()


def redis_roundtrip(url: str = "redis://127.0.0.1:6379/0", count: int = 2000) -> None:
    """What the next layer costs: one GET of a missing key (read only)."""
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        client.ping()
    except Exception as exc:
        print(f"redis GET: not measured ({exc!r})")
        return
    per = timed("", lambda: [client.get("bench:missing") for _ in range(count)], count)
    print(f"for scale, one redis GET round trip: {per:,.0f} ns")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
