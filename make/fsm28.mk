# The original django-fsm leg: a venv of its own, .venv-fsm28, built from pyproject like
# .venv (the project, its extras, the test group), then django-fsm-2 replaced by the
# archived django-fsm 2.8.x a shop may still pin. Both packages install the module
# django_fsm, so the first is uninstalled before the second is installed: never one over
# the other. `make test` runs a subset of the suite in it (tests/support/matrix.py).
VENV_FSM28 ?= .venv-fsm28
DJANGO_FSM_ORIGINAL ?= django-fsm==2.8.2

$(VENV_FSM28)/.installed: pyproject.toml
	test -x $(VENV_FSM28)/bin/python || $(PYTHON) -m venv $(VENV_FSM28)
	$(VENV_FSM28)/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(VENV_FSM28)/bin/python -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]" --group test
	$(VENV_FSM28)/bin/python -m pip uninstall -q -y django-fsm-2 django-fsm
	$(VENV_FSM28)/bin/python -m pip install -q --disable-pip-version-check "$(DJANGO_FSM_ORIGINAL)"
	touch $@

.PHONY: venv-fsm28
venv-fsm28: $(VENV_FSM28)/.installed
