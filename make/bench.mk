# `make bench`: installs the benchmark dependency group and prints one table (under 10 minutes).
# Needs PostgreSQL, Redis and RabbitMQ as for the tests, and wrk for the real-server HTTP
# section (installed with apt-get where it runs as root; else that section says n/a);
# uses its own database BENCH_DB_NAME.
# Each run is appended to build/bench/results.jsonl; BENCH_ARGS=--chart also writes
# docs/img/benchmarks.png. BENCH_ARGS may name sections: BENCH_ARGS="consumer http".
# Its own venv, .venv-bench: the project, the test group and the benchmark's peers (bench
# group), so the peers never land in the development .venv the tests run in.
VENV_BENCH ?= .venv-bench
BENCH_PY ?= $(VENV_BENCH)/bin/python
BENCH_DB_NAME ?= bench_idempotent_orders
BENCH_ARGS ?=
# The outbox section's second peer (django-reliable-outbox) needs Python >= 3.12: its own
# venv (the project and pyproject's bench-peer group), driven by the section as a
# subprocess. Without such a Python the section says n/a for that peer.
VENV_BENCH_PEER ?= .venv-bench-peer

$(VENV_BENCH_PEER)/.installed: pyproject.toml
	test -x $(VENV_BENCH_PEER)/bin/python || $(PYTHON_DJ6) -m venv $(VENV_BENCH_PEER)
	$(VENV_BENCH_PEER)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV_BENCH_PEER)/bin/python -m pip install -q --disable-pip-version-check -e '.[postgres]' --group bench-peer
	touch $@

$(VENV_BENCH)/.installed: pyproject.toml
	test -x $(VENV_BENCH)/bin/python || $(PYTHON) -m venv $(VENV_BENCH)
	$(VENV_BENCH)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV_BENCH)/bin/python -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" --group test --group bench
	touch $@

.PHONY: bench
bench: $(VENV_BENCH)/.installed
	@if [ -n "$(PYTHON_DJ6)" ]; then $(MAKE) --no-print-directory $(VENV_BENCH_PEER)/.installed; \
	else echo "no Python >= 3.12: the outbox section will say n/a for django-reliable-outbox"; fi
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& echo "installing wrk (the real-server HTTP section's load)" \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q wrk >/dev/null; } \
		|| echo "wrk not found: the real-server HTTP section will say n/a (apt-get install wrk)"
	BENCH_DB_NAME=$(BENCH_DB_NAME) IO_TEST_NAMESPACE=$(BENCH_DB_NAME) BENCH_PEER_PYTHON=$(VENV_BENCH_PEER)/bin/python $(BENCH_PY) -m bench $(BENCH_ARGS)

# `make bench-long`: what does not fit the ten minutes of `make bench`. For now the
# memory figure at its target size: BENCH_LONG_MESSAGES (1,000,000) messages
# through the batch loop, reporting peak RSS and the Bloom filter's size.
BENCH_LONG_MESSAGES ?= 1000000

.PHONY: bench-long
bench-long: $(VENV_BENCH)/.installed
	BENCH_DB_NAME=$(BENCH_DB_NAME) IO_TEST_NAMESPACE=$(BENCH_DB_NAME) \
	BENCH_MEMORY_MESSAGES=$(BENCH_LONG_MESSAGES) $(BENCH_PY) -m bench memory $(BENCH_ARGS)
