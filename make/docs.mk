# `make docs`: installs the docs dependency group into the venv (once per pyproject change)
# and builds the site into build/site/. --strict turns every MkDocs warning (broken link,
# bad anchor, docstring trouble) into a failure; the generated parts come from docs/gen/hooks.py.

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check --group docs
	touch $@

.PHONY: docs
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
