"""A train step that calls `optim.update`, lowered for another platform and exported with `jax.export`
(`optim._engine.kernel_choice`: the CPU kernel only where it will run; `optim._base.export`: optim's pytree types
registered for export's serialization)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import optim
from jax._src.export import _export as export_internals   # the registry of serializable pytree nodes
from tests.test_pack import assert_ulp, grads_at, model

RULE = optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(0.01, weight_decay=0.1))))
KERNEL_RULE = optim.chain(optim.ClipGlobalNorm(5.0), optim.Adam(0.01))   # runs in the kernel on CPU


def step(state, m, g):
    return optim.update(state, m, g)


def lowered_text(rule, **lower):
    m = model()
    return jax.jit(step).trace(optim.setup(rule, m), m, grads_at(0, m)).lower(**lower).as_text()


def test_cpu_lowering_runs_the_kernel():
    assert "optim_fused" in lowered_text(KERNEL_RULE)


@pytest.mark.parametrize("platforms", [("cuda",), ("tpu",), ("rocm",)])
def test_lowered_for_another_platform_has_no_kernel(platforms):
    """Ahead-of-time lowering for a GPU or TPU on a CPU host: XLA's code, no custom call of optim's."""
    text = lowered_text(KERNEL_RULE, lowering_platforms=platforms)
    assert "optim_fused" not in text and "custom_call" not in text


def test_lowered_for_several_platforms_has_a_branch_each():
    text = lowered_text(KERNEL_RULE, lowering_platforms=("cpu", "cuda"))
    assert "optim_fused" in text and "stablehlo.case" in text


@pytest.mark.parametrize("rule", [KERNEL_RULE, RULE, optim.by_path({"mat": optim.Muon(0.01), "*": optim.Lion()})],
                         ids=["kernel", "production", "Muon"])
@pytest.mark.parametrize("platforms", [["cpu"], ["cuda"], ["tpu"], ["cpu", "cuda"]])
def test_export_of_a_train_step(rule, platforms):
    """Exported for any platform: no custom call of optim's (jax.export refuses unstable ones), and run here
    (where the platforms include the CPU) it gives the numbers of `optim.update`."""
    m = model()
    state, g = optim.setup(rule, m), grads_at(0, m)
    exp = export.export(jax.jit(step), platforms=platforms)(state, m, g)
    assert "optim_fused" not in exp.mlir_module()
    if "cpu" in platforms:
        got_state, got = exp.call(state, m, g)
        want_state, want = step(state, m, g)
        assert_ulp(got, want)
        assert_ulp(optim.state_dict(got_state), optim.state_dict(want_state))


def node_types(treedef):
    out, todo = set(), [treedef]
    while todo:
        t = todo.pop()
        data = t.node_data()
        if data is not None:
            out.add(data[0])
        todo += t.children()
    return out


def test_every_pytree_type_of_a_state_is_registered_for_export():
    """The tree of a state (rules, their states' named tuples, the packed small leaves, schedules) has only
    types export can serialize, each of whose static data reads back equal."""
    rest = optim.MixedPrecision(jnp.float32, optim.chain(optim.AccumGrad(2), optim.Nesterov(optim.WSD(0.1, 2, 2, 4)),
                                                         optim.RAdam()))
    rule = optim.by_path({"big*": RULE, "*": rest})
    state = optim.setup(rule, model())
    builtin = {dict, list, tuple, type(None)}
    types = node_types(jax.tree.structure(state)) - builtin
    assert {optim.State, optim.SkipNonFinite, optim.AdamW, optim.WSD} <= types
    for t in types:
        assert t in export_internals.serialization_registry, t
    _, aux = jax.tree.structure(state).node_data()
    name, dumps = export_internals.serialization_registry[optim.State]
    assert name == "optim:optim._core.state.State"
    assert export_internals.deserialization_registry[name][1](dumps(aux)) == aux


@pytest.mark.skipif(importlib.util.find_spec("flatbuffers") is None,
                    reason="jax.export's serialization needs the flatbuffers package")
def test_exported_train_step_serializes_and_runs():
    m = model()
    state, g = optim.setup(RULE, m), grads_at(0, m)
    blob = export.export(jax.jit(step), platforms=["cpu", "cuda"])(state, m, g).serialize()
    got_state, got = export.deserialize(blob).call(state, m, g)
    assert_ulp(got, step(state, m, g)[1])
    assert jax.tree.structure(got_state) == jax.tree.structure(state)


def test_a_user_rule_is_registered_once_even_if_defined_twice():
    for _ in range(2):
        class Sign(optim.Rule):
            lr: float = 0.1

            def apply(self, state, x, dx, *dxs):
                return state, self.lr * jnp.sign(dx)
    assert export_internals.serialization_registry[Sign][0].endswith("Sign")
    x = jnp.ones(3)
    exp = export.export(jax.jit(step), platforms=["cpu"])(optim.setup(Sign(), x), x, x)
    np.testing.assert_allclose(exp.call(optim.setup(Sign(), x), x, x)[1], x - 0.1)


def test_meta_gradient_through_the_kernel_is_xla_s():
    """Differentiated with respect to the learning rate, the kernel's step has XLA's path's derivative."""
    m = model()
    g = grads_at(0, m)

    def loss(lr):
        state = optim.setup(optim.Adam(0.01), m)
        state = optim.adjust(state, lr=lr)
        _, new = optim.update(state, m, g)
        return sum(jnp.sum(a) for a in jax.tree.leaves(new))

    got = jax.grad(loss)(0.01)
    assert np.isfinite(got) and got != 0
