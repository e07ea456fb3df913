# The two Quick-start commands: `make run` (the demo) and `make test` (lint, then the full suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test venv bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvatlas demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .kvatlas .pytest_cache .hypothesis
