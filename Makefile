# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench dist clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	$(BIN)/python examples/train_tied_lm.py

test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	$(BIN)/python -m ruff check optim tests examples bench notebooks
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site   # the docs site (build/ is ignored by git)
	$(BIN)/python -m pytest -q

bench: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench --skip many   # the 10000-leaf workload alone: python -m bench --only many (~45 min)

# The sdist and the wheel of the distribution optim-jax (import name optim) in dist/. `make test` builds both
# in a temporary folder and smoke-tests the wheel in a fresh virtual environment (tests/test_packaging.py).
dist: $(BIN)/python
	$(BIN)/python -m pip install -q build
	$(BIN)/python -m build --outdir dist

clean:
	rm -rf $(VENV) *.egg-info build dist
