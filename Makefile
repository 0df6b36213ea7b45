# ckptq: `make demo` sets up and converts a demo checkpoint; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ckptq-installed

.PHONY: setup demo test bench clean

# torch is pinned to the CPU build first: an unpinned torch requirement on a machine without torch
# pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	mkdir -p demo
	$(BIN)/python tools/make_checkpoint.py --size tiny --out demo/ckpt.pt
	$(BIN)/ckptq info demo/ckpt.pt
	$(BIN)/ckptq convert demo/ckpt.pt --force
	$(BIN)/ckptq info demo/ckpt.q8.safetensors
	$(BIN)/ckptq expand demo/ckpt.q8.safetensors -o demo/ckpt_fp32.pt --force

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m pip install -q -e '.[test,bench]'

clean:
	rm -rf $(VENV) demo build *.egg-info
