# `make docs`: installs the docs dependency group into the venv (once per pyproject change)
# and builds the site into build/site/. --strict turns every MkDocs warning (broken link,
# bad anchor, docstring trouble) into a failure; the generated parts come from docs/gen/hooks.py.

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check --group docs
	touch $@

.PHONY: docs
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# `make docs-gen`: write the generated parts (settings and checks tables, state graphs,
# commands, code regions of tested files) into the pages themselves, where a reader of the repository sees them;
# tests/project/test_docs.py fails while a page's parts are stale.
.PHONY: docs-gen
docs-gen: venv
	$(PY) docs/gen/hooks.py
