# `make bench`: installs the benchmark dependency group and prints one table (under 10 minutes).
# Needs PostgreSQL, Redis and RabbitMQ as for the tests; uses its own database BENCH_DB_NAME.
BENCH_PY ?= $(PY)
BENCH_DB_NAME ?= bench_idempotent_orders

.PHONY: bench
bench: venv
	$(BENCH_PY) -m pip install -q -e '.[postgres]' --group test --group bench
	BENCH_DB_NAME=$(BENCH_DB_NAME) IO_TEST_NAMESPACE=$(BENCH_DB_NAME) $(BENCH_PY) -m bench
