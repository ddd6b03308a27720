# Reliability: the long, configurable fault-injection run (included by the Makefile).
#
#   make chaos                              200 orders, 15 SIGKILLs, 3 workers, both brokers
#   make chaos CHAOS_ORDERS=1000 CHAOS_KILLS=40 CHAOS_WORKERS=4 CHAOS_SEED=1234
#
# The RabbitMQ leg restarts the broker once (rabbitmqctl stop_app/start_app) only when
# asked: CHAOS_RESTART_RABBITMQ=1 (or IO_CHAOS_RESTART_RABBITMQ=1 in the environment, as
# .ci/run sets it). By default the shared RabbitMQ is left alone.
# Figures of each run are appended to $(CHAOS_REPORT) (one JSON line per broker), under
# build/ (ignored by git) unless CHAOS_REPORT names another file.

CHAOS_ORDERS ?= 200
CHAOS_KILLS ?= 15
CHAOS_WORKERS ?= 3
CHAOS_SEED ?=
CHAOS_EXAMPLES ?= 400
CHAOS_RESTART_RABBITMQ ?= $(or $(IO_CHAOS_RESTART_RABBITMQ),0)
CHAOS_REPORT ?= build/chaos/chaos-report.jsonl
CHAOS_PYTEST ?= .venv/bin/pytest

.PHONY: chaos
chaos:
	@mkdir -p $(dir $(CHAOS_REPORT))
	IO_TEST_DATABASE=$${IO_TEST_DATABASE:-postgres} \
	IO_CHAOS_LONG=1 \
	IO_CHAOS_LONG_ORDERS=$(CHAOS_ORDERS) \
	IO_CHAOS_LONG_KILLS=$(CHAOS_KILLS) \
	IO_CHAOS_LONG_WORKERS=$(CHAOS_WORKERS) \
	$(if $(CHAOS_SEED),IO_CHAOS_SEED=$(CHAOS_SEED)) \
	IO_CHAOS_RESTART_RABBITMQ=$(CHAOS_RESTART_RABBITMQ) \
	IO_CHAOS_REPORT=$(CHAOS_REPORT) \
	IO_HYPOTHESIS_PROFILE=chaos IO_HYPOTHESIS_EXAMPLES=$(CHAOS_EXAMPLES) \
	$(CHAOS_PYTEST) tests/reliability -p no:cacheprovider -rA
