"""The engine's strategies (optim/_engine/strategies.py): registration, which one runs a rule, and that a fallback to
XLA's path is never silent (logged at debug level with its reason)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from optim._core import program as _program
from optim._rules import split as _split
from optim._engine import (fused as _fused, hoist as _hoist, multitensor as _multitensor, onepass as _onepass,
                           strategies as _strategies, xla as _xla)
from tests.test_pack import assert_ulp, grads_at, model


def test_the_kernels_are_registered_and_xla_is_the_fallback():
    assert _strategies.registered() == (_fused.KERNEL, _onepass.ONE_PASS, _xla.XLA)
    switches = [(_fused, "ENABLED"), (_onepass, "ENABLED"), (_onepass, "INTERPRET"), (_multitensor, "INTERPRET"),
                (_hoist, "ENABLED"), (_split, "ENABLED")]
    assert sorted(_strategies.SWITCHES, key=switches.index) == switches
    assert _strategies.key() == tuple(getattr(o, a) for o, a in _strategies.SWITCHES)
    assert _onepass.INTERPRET is False


def test_the_switches_key_the_program_cache(monkeypatch):
    """A program compiled with the kernel on is not reused with it off (the key reads the switches inline), and
    the one compiled with it on is found again when it is back on."""
    m = {**model(), "only_here": jnp.ones(11)}
    state = optim.setup(optim.Adam(0.01), m)
    g = grads_at(0, m)
    on = _program.plan(state, m, (g,), "update")[0]
    monkeypatch.setattr(_fused, "ENABLED", False)
    off = _program.plan(state, m, (g,), "update")[0]
    monkeypatch.setattr(_fused, "ENABLED", True)
    assert off is not on and _program.plan(state, m, (g,), "update")[0] is on


def test_a_request_names_its_fields():
    """The engine's one interface: `run(Request) -> Result`, named fields (what a new strategy implements)."""
    assert _strategies.Request._fields == ("layout", "rule", "stacks", "rows", "members", "stored", "packs",
                                           "params", "grads", "parts", "mirrors", "in_place")
    assert _strategies.Result._fields == ("stored", "params", "packs", "mirrors")


def test_kernel_runs_rules_by_their_declared_formula_not_their_class():
    """A subclass that changes `apply` does not inherit the formula its parent declares."""
    class MyAdam(optim.Adam):
        def apply(self, state, x, dx, *dxs):
            state, step = super().apply(state, x, dx, *dxs)
            return state, 2 * step

    m = model()
    text = jax.jit(lambda s, m, g: optim.update(s, m, g)).lower(optim.setup(MyAdam(0.01), m), m,
                                                                 grads_at(0, m)).as_text()
    assert "optim_fused" not in text
    _, new = optim.update(optim.setup(MyAdam(0.01), m), m, grads_at(0, m))
    _, half = optim.update(optim.setup(optim.Adam(0.01), m), m, grads_at(0, m))
    np.testing.assert_allclose(new["mat"] - m["mat"], 2 * (half["mat"] - m["mat"]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule, reason", [
    (optim.SkipNonFinite(optim.AdaGrad(0.01)), "it has no kernel for this rule"),
    (optim.chain(optim.AccumGrad(2), optim.Adam(0.01)), "it has no kernel for this rule"),
])
def test_a_rule_the_kernel_does_not_run_is_logged(rule, reason, caplog):
    m = {**model(), "only_here": jnp.ones(5)}       # a structure no other test compiled (the log is per compile)
    with caplog.at_level(logging.DEBUG, logger="optim"):
        optim.update(optim.setup(rule, m), m, grads_at(0, m))
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"does not run {type(rule).__name__}" in t and reason in t for t in msgs), msgs


def test_turned_off_kernel_is_logged_and_xla_runs(monkeypatch, caplog):
    monkeypatch.setattr(_fused, "ENABLED", False)
    assert _strategies.key()[_strategies.SWITCHES.index((_fused, "ENABLED"))] is False
    m = {**model(), "only_here": jnp.ones(7)}       # a structure no other test compiled (the log is per compile)
    state = optim.setup(optim.Adam(0.01), m)
    with caplog.at_level(logging.DEBUG, logger="optim"):
        _, got = optim.update(state, m, grads_at(0, m))
    assert any("turned off" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(_fused, "ENABLED", True)
    assert_ulp(got, optim.update(state, m, grads_at(0, m))[1])


def test_a_step_that_cannot_be_hoisted_is_logged(caplog):
    """A rule whose step does not trace on abstract values (it reads a concrete number) runs per stack, said so."""
    class Concrete(optim.Rule):
        lr: float = 0.1

        def init(self, x):
            return jnp.zeros((), jnp.int32)

        def apply(self, state, x, dx, *dxs):
            n = int(state)               # concrete only: not traceable abstractly
            return state + 1, self.lr * dx * (n + 1)

    x = {"a": jnp.ones(3), "b": jnp.ones(3), "only_here": jnp.ones(9)}
    with caplog.at_level(logging.DEBUG, logger="optim"):
        try:
            optim.update(optim.setup(Concrete(), x), x, x)
        except Exception:        # the ordinary path raises the rule's own error; the log says why hoisting gave up
            pass
    assert any("not hoisted" in r.getMessage() for r in caplog.records)


def test_wide_rules_are_those_a_strategy_keeps_stacked(monkeypatch):
    rules = (optim.Adam(), optim.AdaGrad(), optim.chain(optim.ClipGlobalNorm(1.0), optim.Lion()))
    assert _strategies.wide_rules(rules) == frozenset({0, 2})
    monkeypatch.setattr(_fused, "ENABLED", False)
    assert _strategies.wide_rules(rules) == frozenset()


def test_rules_setup_and_adjust_do_not_import_the_engine_strategies():
    """The layering the registry exists for: the rule protocol, the rules, `setup` and `adjust` ask
    `_engine/strategies.py` and never import a strategy, XLA's path or the jaxpr analysis themselves."""
    import ast
    import pathlib

    root = pathlib.Path(optim.__file__).parent
    forbidden = {"fused", "hoist", "jaxpr_deps", "kernel_choice", "xla"}
    files = [root / "_core" / "setup.py", root / "_core" / "adjust.py", *sorted((root / "_rules").glob("*.py"))]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = {(node.module or "").rpartition(".")[2]} | {a.name for a in node.names}
                assert not names & forbidden, f"{f.relative_to(root)} imports {names & forbidden}"


def test_a_later_update_enters_no_engine_module():
    """A later eager call only looks its plan up: the engine's switches are read inline (no call into a strategy),
    so no module of the engine is entered (`python -m bench.path` counts it)."""
    from bench.path import measure

    for name in ("Adam", "AdaGrad"):       # one the kernel runs, one XLA's path runs
        later = measure(name)["later"]["files"]
        assert later == ["_base/cache.py", "_base/tree.py", "_core/layout.py", "_core/program.py", "_core/state.py",
                         "_core/update.py"], (name, later)
