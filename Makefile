# Two entry points (see README): `make demo` sets everything up and runs the main job,
# `make test` sets everything up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LIB := custom_ops/build/libcsa2onnx_ops.so
OP_SOURCES := custom_ops/CMakeLists.txt $(wildcard custom_ops/src/*)

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed $(LIB)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(LIB): $(OP_SOURCES) custom_ops/build.py | $(VENV)/.installed
	$(PY) custom_ops/build.py

demo: setup
	$(PY) -m csa2onnx.export.demo
	$(VENV)/bin/csa2onnx verify goldens/case3_r4_r128.json

# Tests whose oracle is live torch, run again with torch forced onto the AVX2 class, so the
# cross-CPU branch of each runs on every machine (README: "Exact on every CPU").
TORCH_CLASS_TESTS := tests/test_unseen_cases.py tests/test_upstream_cases.py \
	tests/test_torch_linear.py tests/test_cross_cpu.py tests/test_fp8_cases.py
TORCH_AVX2 := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

# pytest-xdist: a worker per core, each test file on one worker (its module fixtures and
# caches built once), in collection order (tests/conftest.py puts the slowest file first).
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

# Without AVX-512 torch runs the AVX2 class already (those variables only cap the
# instruction set): the second run would repeat the first, so it is left out there.
HAS_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo yes)

test: setup
	$(PYTEST)
ifeq ($(HAS_AVX512),yes)
	$(TORCH_AVX2) $(PYTEST) $(TORCH_CLASS_TESTS)
else
	@echo "make test: no AVX-512 here, torch already sums as the AVX2 class: the forced-AVX2 run would repeat the tests above"
endif

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf custom_ops/build $(VENV)
