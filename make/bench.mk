# `make bench`: installs the benchmark dependency group and prints one table (under 10 minutes).
# Needs PostgreSQL, Redis and RabbitMQ as for the tests, and wrk (Debian) for the
# real-server HTTP section (reported n/a without it); uses its own database BENCH_DB_NAME.
# Each run is appended to build/bench/results.jsonl; BENCH_ARGS=--chart also writes
# docs/img/benchmarks.png. BENCH_ARGS may name sections: BENCH_ARGS="consumer http".
BENCH_PY ?= $(PY)
BENCH_DB_NAME ?= bench_idempotent_orders
BENCH_ARGS ?=

.PHONY: bench
bench: venv
	$(BENCH_PY) -m pip install -q -e '.[postgres]' --group test --group bench
	@command -v wrk >/dev/null || echo "wrk not found: the real-server HTTP section will say n/a (apt-get install wrk)"
	BENCH_DB_NAME=$(BENCH_DB_NAME) IO_TEST_NAMESPACE=$(BENCH_DB_NAME) $(BENCH_PY) -m bench $(BENCH_ARGS)

# `make bench-long`: what does not fit the ten minutes of `make bench`. For now the
# memory figure at its target size: BENCH_LONG_MESSAGES (1,000,000) messages
# through the batch loop, reporting peak RSS and the Bloom filter's size.
BENCH_LONG_MESSAGES ?= 1000000

.PHONY: bench-long
bench-long: venv
	$(BENCH_PY) -m pip install -q -e '.[postgres]' --group test --group bench
	BENCH_DB_NAME=$(BENCH_DB_NAME) IO_TEST_NAMESPACE=$(BENCH_DB_NAME) \
	BENCH_MEMORY_MESSAGES=$(BENCH_LONG_MESSAGES) $(BENCH_PY) -m bench memory $(BENCH_ARGS)
