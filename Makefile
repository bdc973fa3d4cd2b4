# Two commands: `make run` (install, then start the whole stack) and `make test` (install, then
# lint, type-check and test). Both set up everything they need on a fresh machine. `make check` is
# the everyday loop: lint, type-check, and the unit and component tests (no `stack` or `slow` tier).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SDK024_VENV ?= .venv-sdk024
# pytest-xdist workers, each taking whole modules (their fixtures shared); two for a 2-core
# machine, where three measured no faster (pytest 9:43 against 9:51). Each worker, and
# every service a test starts, computes on one torch thread (OMP_NUM_THREADS=1): with two workers
# on two cores, more threads only queue for the cores (the unit tier measured 88 s on two threads
# per worker, 67 s on one).
# tests/infra/test_numerics_portability.py re-runs the numerics on two threads.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
TEST_ENV := OMP_NUM_THREADS=1

.PHONY: install browser run test check lint typecheck pytest pytest-fast sdk024 proto clean

install: browser $(VENV)/.installed

# Chromium and its driver from the OS packages, for the console's browser tests (tests/e2e/test_console.py).
# As root on Debian/Ubuntu they are installed when missing; elsewhere those tests skip, with a note here.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
			|| echo "note: apt-get could not install chromium; the console's browser tests will skip"; \
	else echo "note: chromium/chromedriver missing (install them as root); the console's browser tests will skip"; fi

# uv installs the dependencies (about ten times faster than pip here), compiled to bytecode as pip
# does (else the first processes of a test run would each compile torch's and transformers'
# modules); torch alone goes through pip, pinned, which takes this machine's local CPU wheel (uv
# does not look there, and an unpinned torch would be a multi-gigabyte CUDA download).
UV := $(VENV)/bin/uv
UV_VERSION ?= 0.13.9

$(UV):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)

$(VENV)/.installed: pyproject.toml | $(UV)
	$(PY) -m pip install -q torch==2.13.0
	$(UV) pip install -q --compile-bytecode --python $(PY) -e '.[dev,cookbook]'
	$(UV) pip install -q --compile-bytecode --python $(PY) --no-deps tinker-cookbook==0.6.1
	touch $@

# The JSON-era SDK, in its own environment, for the backward-compatibility contract run.
sdk024: $(SDK024_VENV)/.installed

$(SDK024_VENV)/.installed: | $(UV)
	$(PYTHON) -m venv $(SDK024_VENV)
	$(UV) pip install -q --compile-bytecode --python $(SDK024_VENV)/bin/python tinker==0.24.1 numpy
	touch $@

# The gateway's protobuf classes, generated from services/gateway/wire/tinker_public.proto and checked in.
# Regenerate after editing the .proto or when the protobuf runtime's major version moves; protoc comes
# from grpcio-tools, whose protoc must not be newer than the installed protobuf runtime
# (grpcio-tools 1.85.1 ships protoc 35.1: gencode 7.35.1, which protobuf 7.35.1 and later accept).
GRPCIO_TOOLS ?= grpcio-tools==1.85.1
PROTO_DIR := services/gateway/wire
PROTO_GEN_TOOLS := $(abspath build/grpcio-tools)

proto:
	$(PY) -m pip install -q --no-deps --target $(PROTO_GEN_TOOLS) '$(GRPCIO_TOOLS)'
	cd $(PROTO_DIR) && PYTHONPATH=$(PROTO_GEN_TOOLS) $(abspath $(PY)) -m grpc_tools.protoc -I. \
		--python_out=. --pyi_out=. tinker_public.proto
	for f in $(PROTO_DIR)/tinker_public_pb2.py $(PROTO_DIR)/tinker_public_pb2.pyi; do \
		{ echo '# Generated from tinker_public.proto by protoc ($(GRPCIO_TOOLS)): regenerate with `make proto`.'; \
		  cat $$f; } > $$f.tmp && mv $$f.tmp $$f; done

run: install
	$(VENV)/bin/tinkerd up

lint: $(VENV)/.installed
	$(PY) -m ruff check .

typecheck: $(VENV)/.installed
	$(PY) -m mypy .

pytest: install sdk024
	$(TEST_ENV) TINKERD_SDK024_PYTHON=$(abspath $(SDK024_VENV))/bin/python $(PY) -m pytest $(XDIST)

# The setup steps side by side (the environments, the browser, then lint and type-check once the
# environment is in), then the tests.
test:
	$(MAKE) --no-print-directory -j4 lint typecheck browser sdk024
	$(MAKE) --no-print-directory pytest

# Unit and component tests only: what starts a whole stack (marked `stack` by tests/conftest.py) and
# the `slow` tier (faults, chaos, cookbook, console browser, bench smoke, numerics matrix) are left out.
pytest-fast: install
	$(TEST_ENV) $(PY) -m pytest $(XDIST) -m "not stack and not slow"

check:
	$(MAKE) --no-print-directory -j3 lint typecheck
	$(MAKE) --no-print-directory pytest-fast

clean:
	rm -rf $(VENV) $(SDK024_VENV) var
