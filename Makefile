# Two entry points: `make demo` and `make test` (both create .venv on first use).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.grammask-installed
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: setup demo test lint typecheck unit clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt $(wildcard requirements-vllm.txt)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps xgrammar==0.2.8
	$(PIP) -r requirements.txt
	if [ -f requirements-vllm.txt ]; then $(PIP) --no-deps -r requirements-vllm.txt; fi
	$(PIP) --no-deps -e .
	touch $(STAMP)

demo: setup
	$(VENV)/bin/grammask demo

lint: setup
	$(VENV)/bin/ruff check src tests bench

typecheck: setup
	$(VENV)/bin/mypy --strict src bench

unit: setup
	$(VENV)/bin/pytest -q -n 2 --dist loadfile tests

test: lint typecheck unit

clean:
	rm -rf $(VENV)
