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

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf custom_ops/build $(VENV)
