"""The fused step's GPU kernel (optim/_engine/fused_gpu.py), run on the CPU in Pallas's interpret mode in place of
the CPU kernel's calls, against XLA's path: every `kernel` case of the registry whose kind it has (the rule alone,
in a chain with ClipGlobalNorm or a Scale, inside SkipNonFinite, SkipLargeUpdates or an EMA), on tests/test_pack.py's
model (a tie, stacks of one and of four, a scalar; a `None` gradient at a stack, a row and half the tie; a frozen
parameter), with the CPU's stacking and with a GPU process's; which requests it takes. What it compiles to for an
H100 (kernels, bytes) is in tests/test_gpu_kernels.py."""

import jax.numpy as jnp
import pytest

import optim
from optim._engine import backend as _backend
from optim._engine import fused as _fused
from optim._engine import fused_gpu as _gpu
from optim._engine import fused_kinds as _kinds
from rule_cases import table
from tests.test_pack import assert_ulp, grads_at, model

CASES = {c.id: c for c in table("kernel") if _kinds.kind_of(_fused._peel(c.make()).core) in _gpu.KINDS
         and getattr(_fused._peel(c.make()).core, "mu_dtype", None) is None}     # float32 states only


def train(rule, monkeypatch, *, gpu: bool, steps=3):
    monkeypatch.setattr(_fused, "ENABLED", gpu)
    monkeypatch.setattr(_gpu, "INTERPRET", True)
    if gpu:
        monkeypatch.setattr(_fused, "_call", _gpu.call)     # the CPU lowering's calls are the GPU kernel's
    m = model()
    state = optim.freeze(optim.setup(rule, m), "big.2")
    for t in range(steps):
        state, m = optim.update(state, m, grads_at(t, m))
    return state, m


def test_the_cases_cover_every_kind():
    assert {_kinds.kind_of(_fused._peel(c.make()).core) for c in CASES.values()} == set(_gpu.KINDS)


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_xla_s_path(name, layout, monkeypatch):
    """`layout="gpu"`: the state a GPU process sets up (one large parameter a stack), which the kernel's calls
    then group by shape across stacks."""
    if layout == "gpu":
        monkeypatch.setattr(_backend, "_ONLY_CPU", False)
    case = CASES[name]
    got_state, got = train(case.make(), monkeypatch, gpu=True)
    want_state, want = train(case.make(), monkeypatch, gpu=False)
    assert_ulp(got, want)
    assert_ulp(optim.state_dict(got_state), optim.state_dict(want_state), ulps=case.state_ulps)


@pytest.mark.parametrize("n, block", [(8200, 8), (160000, 256), (16384, 2048), (768, 256), (5, 1), (1 << 22, 2048)])
def test_programs_cover_the_members_exactly(n, block):
    """No partial program: on a GPU a Triton load past an array's end is not masked."""
    assert _gpu.block_of(n) == block and n % block == 0


@pytest.mark.parametrize("kind, dtypes, n, ok", [
    (_kinds._ADAM, [jnp.float32], 16384, True),
    (_kinds._ADAMW, [jnp.float32, jnp.float32], 160000, True),
    (_kinds._ADAM, [jnp.float32, jnp.bfloat16], 16384, False),      # a bfloat16 state: XLA's path
    (_kinds._ADAM, [jnp.float32], 8200, False),                     # blocks of 8 numbers: XLA's path
    (_kinds._NADAM, [jnp.float32], 16384, False),                   # a kind it does not have
])
def test_supports(kind, dtypes, n, ok):
    assert _gpu.supports(kind, dtypes, n) is ok


def test_a_request_is_given_the_gpu_kernel_only_where_every_call_has_it(monkeypatch):
    """`_on_gpu`: float32 Adam on 128x128 matrices, yes; with bfloat16 moments or a parameter of 8200, no."""
    seen = []
    real = _fused._on_gpu
    monkeypatch.setattr(_fused, "_on_gpu", lambda r: seen.append(real(r)) or seen[-1])
    monkeypatch.setattr(_fused, "ENABLED", True)
    for rule, params in [(optim.Adam(1e-3), {"a": jnp.ones((128, 128)), "b": jnp.ones((128, 128))}),
                         (optim.Adam(1e-3, mu_dtype=jnp.bfloat16), {"a": jnp.ones((128, 128))}),
                         (optim.Adam(1e-3), {"a": jnp.ones((128, 128)), "b": jnp.ones(8200)})]:
        optim.update(optim.setup(rule, params), params, params)
    assert seen == [True, False, False]
