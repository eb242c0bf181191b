# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	$(BIN)/python examples/train_tied_lm.py

test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m ruff check optim tests examples bench notebooks
	$(BIN)/python -m pytest -q

bench: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench --skip many   # the 10000-leaf workload alone: python -m bench --only many (~45 min)

clean:
	rm -rf $(VENV) *.egg-info
