# Two commands for a newcomer: `make demo` and `make test`. Each builds its
# virtual environment from this project's own files first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The second leg of the matrix: Django 6 on Python 3.12+ (pyenv or system).
PYTHON_DJ6 ?= $(shell for p in $$HOME/.pyenv/versions/3.12*/bin/python3 $$HOME/.pyenv/versions/3.13*/bin/python3 python3.12 python3.13; do "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
VENV_DJ6 ?= .venv-dj6

# mysqlclient compiles against libmariadb; install it where the headers are.
HAVE_MARIADB_HEADERS := $(shell pkg-config --exists libmariadb 2>/dev/null && echo yes || (command -v mariadb_config >/dev/null && echo yes))
comma := ,
EXTRAS := postgres,drf,prometheus$(if $(HAVE_MARIADB_HEADERS),$(comma)mysql)
# Development tools come from pyproject's [dependency-groups] (pip >= 25.1).
GROUPS := --group dev

.PHONY: help venv demo demo-web test lint format clean screenshots

help:
	@echo "make venv        build .venv (the project, its extras and the dev group) from pyproject.toml"
	@echo "make demo        run the demo on the embedded default (SQLite + filesystem broker)"
	@echo "make demo-web    the demo shop at http://127.0.0.1:8000/shop/ with a Celery worker (Ctrl-C stops both)"
	@echo "make test        the test suite: SQLite, PostgreSQL, MariaDB; Django 5.2 and 6.x; a subset on the"
	@echo "                 original django-fsm 2.8.x (.venv-fsm28); prints its wall time"
	@echo "                 (MATRIX_ARGS=... passes options on, e.g. MATRIX_ARGS='--databases postgres')"
	@echo "make lint        ruff check, ruff format --check, mypy"
	@echo "make format      ruff format and ruff check --fix"
	@echo "make docs        build the documentation site (MkDocs, --strict) into build/site/"
	@echo "make docs-gen    write the generated parts (settings, checks, graphs, code regions) into docs/"
	@echo "make venv-fsm28  build .venv-fsm28: the project on the original django-fsm 2.8.x (make test builds it)"
	@echo "make chaos       the long fault-injection run (CHAOS_ORDERS, CHAOS_KILLS, CHAOS_WORKERS, CHAOS_SEED;"
	@echo "                 CHAOS_RESTART_RABBITMQ=1 restarts the shared RabbitMQ once); report in build/chaos/"
	@echo "make bench       the benchmark table (its own .venv-bench and .venv-bench-peer; BENCH_ARGS=sections)"
	@echo "make bench-long  the benchmark's memory figure at 1,000,000 messages (BENCH_LONG_MESSAGES)"
	@echo "make bench-dedup the dedup layers' benchmark (Bloom filter vs bit array)"
	@echo "make screenshots the browser tests' pictures (PostgreSQL), copied into docs/img/ for docs/operations.md"
	@echo "make clean       remove .demo and the tools' caches"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" $(GROUPS)
	touch $@

venv: $(VENV)/.installed

$(VENV_DJ6)/.installed: pyproject.toml
	@test -n "$(PYTHON_DJ6)" || { echo "no Python >= 3.12 found for the Django 6 leg"; exit 1; }
	test -x $(VENV_DJ6)/bin/python || $(PYTHON_DJ6) -m venv $(VENV_DJ6)
	$(VENV_DJ6)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV_DJ6)/bin/python -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" $(GROUPS) "Django>=6.0"
	touch $@

demo: venv
	rm -rf .demo
	$(PY) manage.py migrate -v0
	$(PY) manage.py run_demo $(DEMO_ARGS)

# The shop to click through: runserver and one Celery worker (with beat: the reconciler)
# on the same embedded default as `make demo`, kept in .demo/ between runs. Ctrl-C stops
# the server; the trap then stops the worker (a background job ignores Ctrl-C itself).
DEMO_WEB_ADDR ?= 127.0.0.1:8000

demo-web: venv
	$(PY) manage.py migrate -v0
	$(PY) -m celery -A demo_project worker --beat --schedule .demo/celerybeat-schedule \
		--concurrency 2 --loglevel warning & worker=$$!; \
	trap 'kill -TERM $$worker 2>/dev/null; wait $$worker' EXIT INT TERM; \
	echo "the shop: http://$(DEMO_WEB_ADDR)/shop/  (Ctrl-C stops the server and the worker)"; \
	$(PY) manage.py demo_superuser --url http://$(DEMO_WEB_ADDR)/admin/; \
	$(PY) manage.py runserver $(DEMO_WEB_ADDR)

# The Django 6 leg needs Python >= 3.12; without one (and outside CI) it is
# reported as not run. tests/support/matrix.py decides which database legs run.
# The original django-fsm leg runs in its own venv (make/fsm28.mk).
test: venv
	@if [ -n "$(PYTHON_DJ6)" ]; then $(MAKE) --no-print-directory $(VENV_DJ6)/.installed; fi
	@$(MAKE) --no-print-directory $(VENV_FSM28)/.installed
	$(PY) tests/support/matrix.py --venv $(VENV) $(if $(PYTHON_DJ6),--venv-dj6 $(VENV_DJ6)) \
		--venv-fsm28 $(VENV_FSM28) $(MATRIX_ARGS)

# The pictures of docs/operations.md: the browser tests write them outside the checkout
# (build/screenshots/), then the ones the page shows are copied into docs/img/.
SHOTS := build/screenshots
DOC_SHOTS := admin-index-1280 admin-refused-list-1280 admin-order-timeline-1280 \
	shop-your-orders-1280 shop-order-paid-1280 admin-dead-worker-1280

screenshots: venv
	rm -rf $(SHOTS)
	IO_TEST_SCREENSHOTS=$(CURDIR)/$(SHOTS) IO_TEST_DATABASE=postgres $(PY) -m pytest -q -p no:cacheprovider \
		tests/admin/test_screens_browser.py
	IO_TEST_SCREENSHOTS=$(CURDIR)/$(SHOTS) $(PY) -m pytest -q -p no:cacheprovider tests/demo/test_demo_liveness.py
	for name in $(DOC_SHOTS); do cp $(SHOTS)/$$name.png docs/img/$$name.png; done

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache

-include make/*.mk
