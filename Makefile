# Two commands on a fresh clone: `make serve` and `make test`. Each creates .venv if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: pip takes the local CPU wheel here (an unpinned torch pulls a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(STAMP)

.PHONY: venv serve test lint bench
venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/tetri-server serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check tetri_server tests tools
	$(BIN)/mypy tetri_server/policy tetri_server/kv tetri_server/messages.py tetri_server/config
