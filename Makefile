# `make demo` and `make test` set up .venv themselves (Python 3.11, gcc and make are all they need).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODEL ?= examples/models/bert_tiny.onnx

.PHONY: setup setup-targets test typecheck demo bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,peers,serve]'
	touch $(STAMP)

setup: $(STAMP)

# Cross toolchain + qemu-user + aarch64 TVM runtime, and cuobjdump (needs root for apt-get).
setup-targets: $(STAMP)
	VENV=$(VENV) bash scripts/setup_targets.sh

# One worker per core, each test file on one worker (its module fixtures built once).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile

# Compile + verify the bundled BERT-style model, then time it against ONNX Runtime and stock TVM.
demo: $(STAMP)
	$(BIN)/tvm-fusion compile $(MODEL) -o build
	$(BIN)/tvm-fusion bench $(MODEL) --repeat 20 --json build/bench-$(notdir $(basename $(MODEL))).json

# The transformer examples side by side (docs/benchmarks/index.md lists every benchmark).
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_examples.py

# The documentation site, strict: a broken link or anchor, a page missing from the nav, or a
# generated table that cannot be made (scripts/gen_docs.py, the MkDocs hook) fails the build.
$(VENV)/.docs-stamp: pyproject.toml $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

# mypy over the public Python API (the files in pyproject.toml's [tool.mypy]).
typecheck: $(STAMP)
	$(BIN)/mypy

docs: $(VENV)/.docs-stamp
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

clean:
	rm -rf build .pytest_cache
