# ckptq: `make demo` sets up and converts a demo checkpoint; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# PyTorch's own index of CPU-only builds. On PyPI, torch for Linux is the CUDA build, which pulls several
# GB of nvidia-* packages; the same release from this index is the ~200 MB CPU build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_STAMP := $(VENV)/.torch-$(TORCH_VERSION)
STAMP := $(VENV)/.ckptq-installed
TEST_STAMP := $(VENV)/.ckptq-test-installed

.PHONY: setup setup-test demo test bench clean

# The pinned CPU build of torch goes in first, so that nothing pulls the CUDA build. Linux: a CPU wheel
# already at hand (pip's find-links or a local mirror) is used as it is; otherwise it comes from PyTorch's
# CPU index. Its dependencies then come from the usual index. Elsewhere (macOS) PyPI's torch is CPU-only.
$(TORCH_STAMP):
	$(PY) -m venv $(VENV)
ifeq ($(shell uname -s),Linux)
	$(BIN)/python -m pip install -q --no-deps --no-index "torch==$(TORCH_VERSION)+cpu" 2>/dev/null \
	  || $(BIN)/python -m pip install -q --no-deps --index-url $(TORCH_CPU_INDEX) "torch==$(TORCH_VERSION)+cpu"
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)+cpu"
else
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"
endif
	touch $@

# The package alone: all that the demo needs.
$(STAMP): $(TORCH_STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

# The test extras on top (pytest, hypothesis, triton for its interpreter tests, bitsandbytes, torchao).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)

setup-test: $(TEST_STAMP)

demo: setup
	mkdir -p demo
	$(BIN)/python tools/scripts/make_checkpoint.py --size tiny --out demo/ckpt.pt
	$(BIN)/ckptq info demo/ckpt.pt
	$(BIN)/ckptq convert demo/ckpt.pt --force
	$(BIN)/ckptq info demo/ckpt.q8.safetensors
	$(BIN)/ckptq expand demo/ckpt.q8.safetensors -o demo/ckpt_fp32.pt --force

# Two pytest-xdist workers: the suite's subprocess-heavy tests leave a core idle when run one by one.
# Modules that launch process groups run in one scope, one after another (tests/conftest.py).
TEST_WORKERS ?= 2

test: setup-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

bench: setup-test
	$(BIN)/python -m pip install -q -e '.[test,bench]'

clean:
	rm -rf $(VENV) demo build *.egg-info
