# mxval: `make validate` and `make test` set everything up themselves.
#
# When the running Python already imports torch and triton (a ROCm/CUDA image, the GPU
# machine), that environment is used as it is and nothing is installed over it.
# Otherwise a venv is created in .venv with the pinned CPU builds (constraints.txt).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
REPORT_DIR ?= reports/validate
JOBS ?= 2

SYSTEM_STACK := $(shell $(PYTHON) -c 'import torch, triton' >/dev/null 2>&1 && echo yes)
ifeq ($(SYSTEM_STACK),yes)
  PY := $(PYTHON)
  ENV_STAMP := .mxval-env-system
  export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
else
  PY := $(VENV)/bin/python
  ENV_STAMP := $(VENV)/.mxval-installed
endif
MXVAL := $(PY) -m harness

.PHONY: readme-coverage report-screenshot env lint test test-slow test-upstream test-aiter test-gpu validate selftest bench bench-reference bench-gpu readme-matrix study readme-study clean check-upstream

env: $(ENV_STAMP)

$(VENV)/.mxval-installed: pyproject.toml constraints.txt
	@echo "mxval: creating $(VENV) and installing the pinned CPU stack (constraints.txt: torch, triton, pandas, matplotlib, pytest, ...); a first install downloads about 1 GB and takes minutes"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -c constraints.txt torch triton -e '.[test]'
	touch $@

.mxval-env-system: pyproject.toml tools/ensure_env.py
	$(PY) tools/ensure_env.py
	touch $@

# Lint (pyproject [tool.ruff]: real errors and import order). The venv always has ruff; a
# system stack without it (a GPU image, no network) says so and goes on to the tests.
lint: $(ENV_STAMP)
	@if $(PY) -m ruff --version >/dev/null 2>&1; then $(PY) -m ruff check . ; \
	else echo "mxval: ruff is not installed in this Python: lint skipped"; fi

# CPU suite: lint, unit tests, the Triton backend through the interpreter, the smoke suite
# and the CI part of the selftest (they are tests under tests/). It leaves out the tests
# marked gpu, upstream and slow, and its summary counts them per mark with the target that
# runs them (tests/conftest.py). Budget: 5 minutes and 4 GB on 2 cores (reports/bench-make-test.md).
XDIST = $(if $(shell $(PY) -c 'import xdist' 2>/dev/null && echo y),-n $(JOBS))
test: $(ENV_STAMP) lint
	$(PY) -m pytest -q -m "not gpu and not slow and not upstream" $(XDIST)

# The CPU tests over the CI budget of `make test` (time or memory: the 2 GiB pool needs
# about 6.5 GB of RAM).
test-slow: $(ENV_STAMP)
	$(PY) -m pytest -q -m "slow and not gpu and not upstream" $(XDIST)

# vLLM's real kernels (loaded from the fetched release, never imported) through the Triton
# interpreter on smoke-size cases: fetches the wheel once (no dependencies; cached in
# ~/.cache/mxval/upstream), then runs the tests marked `upstream`.
test-upstream: $(ENV_STAMP)
	$(MXVAL) upstream fetch
	$(PY) -m pytest -q -m "upstream and not gpu"

# aiter's real K writer and Q quant (wrappers + Triton kernels, loaded from the aiter tree
# AITER=DIR, never imported; its files must match optimized/upstream.py's pins) through the
# Triton interpreter, byte for byte against the reference (tests marked `upstream`).
test-aiter: $(ENV_STAMP)
	@if [ -z "$(AITER)" ]; then echo "mxval: make test-aiter: give the aiter tree, AITER=DIR"; exit 2; fi
	MXVAL_AITER_SRC="$(abspath $(AITER))" $(PY) -m pytest -q -m "upstream and not gpu" tests/test_aiter_upstream.py

# GPU suite: compiled Triton against the reference (an NVIDIA or AMD GPU).
test-gpu: $(ENV_STAMP)
	$(PY) -m pytest -q -m gpu

validate: $(ENV_STAMP)
	$(MXVAL) validate --suite default --backend auto -j $(JOBS) --report-dir $(REPORT_DIR) --force

selftest: $(ENV_STAMP)
	$(MXVAL) selftest --report-dir reports/selftest --force

bench: $(ENV_STAMP)
	$(PY) -m harness.bench.reference
	$(PY) -m harness.bench.resources --out reports/bench-resources.md

# GPU benchmark of the Triton kernels at V4-Pro shapes -> reports/bench-gpu.md
BENCH_GPU_OUT ?= reports/bench-gpu.md
bench-gpu: $(ENV_STAMP)
	$(PY) -m harness.bench.gpu --out $(BENCH_GPU_OUT)

study: $(ENV_STAMP)
	$(MXVAL) study --report-dir reports/study --force

# The adapters' and the capture hook's upstream targets (optimized/upstream.py) against a
# vLLM release, read with ast: the wheel is downloaded once (no dependencies) into
# ~/.cache/mxval/upstream. VLLM=VERSION picks the release (default: the newest on the
# package index), AITER=DIR adds an aiter tree.
check-upstream: $(ENV_STAMP)
	$(MXVAL) upstream fetch $(if $(VLLM),--vllm $(VLLM))
	$(MXVAL) upstream check $(if $(VLLM),--vllm $(VLLM)) $(if $(AITER),--aiter $(AITER))

clean:
	rm -rf $(VENV) .mxval-env-system build *.egg-info

# The fault x metric matrix of the selftest, spliced into README.md.
readme-matrix: $(ENV_STAMP)
	$(MXVAL) selftest --quick --report-dir reports/selftest --force --markdown docs/selftest-matrix.md
	$(PY) tools/splice_readme.py matrix docs/selftest-matrix.md

# The coverage tables spliced into README.md: the default suite here; the full suite's table
# (docs/coverage-full.md) comes from `mxval coverage --suite full --markdown` on a GPU.
readme-coverage: $(ENV_STAMP)
	$(MXVAL) coverage --suite default -q --markdown docs/coverage-default.md
	{ cat docs/coverage-default.md; echo; cat docs/coverage-full.md; } > reports/coverage-readme.md
	$(PY) tools/splice_readme.py coverage reports/coverage-readme.md

readme-study: $(ENV_STAMP)
	$(MXVAL) study --report-dir reports/study --force --readme docs/study-summary.md
	$(PY) tools/splice_readme.py study docs/study-summary.md

# docs/report-example.png: the HTML report of a failing run (the smoke suite with a K-writer
# fault) as headless Chromium draws it (tools/chromium.py; Debian: apt-get install chromium).
report-screenshot: $(ENV_STAMP)
	$(MXVAL) validate --suite smoke --backend fault:nibbles-swapped --budgets cases/budgets.toml -q --report-dir reports/report-example --force || test $$? -eq 1
	$(PY) tools/chromium.py screenshot reports/report-example/report.html docs/report-example.png --height 2400
