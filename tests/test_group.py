"""optim._engine.group: XLA's path stacks large parameters that share a rule, shape, dtype and placement (on a
GPU or TPU by default; `MODE = "all"` here, on the CPU, with the fused kernel off). The reference is the same
path one parameter a stack (`MODE = "0"`): results agree to a few ulp (the same arithmetic, vmapped over a stack
instead of run alone), the per-parameter views (`state_dict`, checkpoints) are unchanged, and only the rules
whose step does not read the parameter are grouped."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optim
from conftest import counted_update
from optim._engine import fused as _fused
from optim._engine import group as _group
from optim._engine import onepass
from optim._engine import stack as _stack

BIG = (100, 100)      # 10000 elements: above optim._engine.stack.STACK_MAX_SIZE, alone unless grouped


@pytest.fixture(autouse=True)
def _xla_path(monkeypatch):
    monkeypatch.setattr(_fused, "ENABLED", False)


def _model():
    k = jax.random.split(jax.random.PRNGKey(0), 10)
    m = {f"w{i}": jax.random.normal(k[i], BIG) for i in range(6)}
    m["wide"] = [jax.random.normal(k[6], (90, 120)), jax.random.normal(k[7], (90, 120))]
    m["b"] = jax.random.normal(k[8], (7,))
    m["tied"] = m["w0"]                      # a tie: one parameter, its gradients summed
    m["n"] = 3                               # not trainable
    return m


def _grads(model, t):
    g = jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)) + 0.1 * x if isinstance(x, jax.Array) else None, model)
    if t == 1:
        g["w3"] = None                       # no step for w3, its state not advanced
    return g


class _Normed(optim.Rule):
    """Descent whose state keeps the parameter's norm (a read that is not elementwise)."""

    def init(self, x):
        return jnp.zeros((), x.dtype)

    def apply(self, state, x, dx):
        return jnp.sqrt(jnp.sum(x * x)), 1e-2 * dx


class _Branching(optim.Rule):
    """Descent with a weight decay, by a conditional on a hyperparameter (a predicate vmap does not batch: the
    conditional stays one)."""

    decay: float = 0.1

    def init(self, x):
        return ()

    def apply(self, state, x, dx):
        return state, jax.lax.cond(self.decay > 0, lambda d, a: 1e-2 * (d + self.decay * a),
                                   lambda d, a: 1e-2 * d, dx, x)


RULES = {
    "Adam": lambda: optim.Adam(1e-2),
    "Adam bf16 moments": lambda: optim.Adam(1e-2, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
    "clip+Adam": lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam(1e-2)),
    "SkipNonFinite(Adam)": lambda: optim.SkipNonFinite(optim.Adam(1e-2)),
    "AdamW": lambda: optim.AdamW(1e-2, weight_decay=0.1),
    "clip+AdamW": lambda: optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-2, weight_decay=0.1)),
    "Cautious(AdamW)": lambda: optim.Cautious(optim.AdamW(1e-2, weight_decay=0.1)),
    "Lion+WeightDecay": lambda: optim.chain(optim.Lion(1e-3), optim.WeightDecay(1e-2)),
    "Lion": lambda: optim.Lion(1e-3),
    "Muon": lambda: optim.by_path({"b": optim.Adam(1e-2), "*": optim.Muon(1e-2)}),   # Newton-Schulz batched
    "Adafactor": lambda: optim.Adafactor(1e-2),
    "EMA(AdamW)": lambda: optim.EMA(optim.AdamW(1e-2, weight_decay=0.1), 0.9),
    "SkipNonFinite(AdamW)": lambda: optim.SkipNonFinite(optim.AdamW(1e-2, weight_decay=0.1)),
    "SkipNonFinite(EMA(clip+AdamW))": lambda: optim.SkipNonFinite(optim.EMA(optim.chain(
        optim.ClipGlobalNorm(1.0), optim.AdamW(1e-2, weight_decay=0.1)), 0.9)),
    "EMA(Adam)": lambda: optim.EMA(optim.Adam(1e-2), 0.9),
    "MixedPrecision(AdamW)": lambda: optim.MixedPrecision(optim.AdamW(1e-2, weight_decay=0.1)),
    "Momentum": lambda: optim.Momentum(1e-2),
    "RMSProp centred": lambda: optim.RMSProp(1e-2, centred=True),
    "Adam lr schedule": lambda: optim.Adam(optim.warmup_cosine(1e-2, 2, 10)),
    "by_path": lambda: optim.by_path({"wide.*": optim.Lion(1e-3), "*": optim.AdamW(1e-2, weight_decay=0.1)}),
}


def _run(make, mode, monkeypatch, steps=3, freeze=None):
    monkeypatch.setattr(_group, "MODE", mode)
    model = _model()
    state = optim.setup(make(), model)
    if freeze:
        state = optim.freeze(state, freeze)
    f = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))
    x = jax.tree.map(lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, model)
    x["tied"] = x["w0"]
    for t in range(steps):
        state, x = f(state, x, _grads(model, t))
    return state, x


def _close(a, b):
    """Equal to a few ulp of each array's scale (XLA may contract a multiply and an add in one program and not in
    the other); bfloat16 arrays to one of their own ulp; integers exactly."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        eps = 2.0 ** -7 if np.asarray(v).dtype == jnp.bfloat16 else 2.0 ** -23
        u, v = np.asarray(u).astype(np.float64), np.asarray(v).astype(np.float64)
        scale = np.max(np.abs(v)) if v.size else 0.0
        np.testing.assert_allclose(u, v, rtol=0, atol=8 * eps * scale)


@pytest.mark.parametrize("name", sorted(RULES))
def test_grouped_step_equals_one_parameter_a_stack(name, monkeypatch):
    got_state, got = _run(RULES[name], "all", monkeypatch)
    want_state, want = _run(RULES[name], "0", monkeypatch)
    assert len(got_state.layout.stacks) < len(want_state.layout.stacks)       # grouped
    assert np.array_equal(got["tied"], got["w0"]) and not np.array_equal(got["w0"], _model()["w0"])
    _close(got, want)
    _close(optim.state_dict(got_state), optim.state_dict(want_state))


SMALL_RULES = {
    "AdamW": lambda: optim.AdamW(1e-2, weight_decay=0.1),
    "EMA(AdamW)": lambda: optim.EMA(optim.AdamW(1e-2, weight_decay=0.1), 0.9),
    "SkipNonFinite(EMA(AdamW))": lambda: optim.SkipNonFinite(optim.EMA(optim.AdamW(1e-2, weight_decay=0.1), 0.9)),
}


@pytest.mark.parametrize("name", sorted(SMALL_RULES))
def test_small_stacks_of_a_grouped_rule_step_member_by_member(name, monkeypatch):
    """XLA's path steps a grouped rule's stacks of small parameters member by member too (optim._engine.members:
    read through their concatenation, XLA copied each new parameter out): the stacked step's values."""
    from optim._engine import members

    seen = []
    real = members.evaluate
    monkeypatch.setattr(members, "evaluate", lambda fn, st, ms: seen.append(ms) or real(fn, st, ms))
    model = {f"b{i}": jax.random.normal(jax.random.key(i), (8, 16)) for i in range(5)}

    def run(mode):
        monkeypatch.setattr(_group, "MODE", mode)
        state, x = optim.setup(SMALL_RULES[name](), model), model
        f = jax.jit(lambda s, m, g: optim.update(s, m, g))
        for t in range(3):
            g = {k: jnp.cos(v * (t + 1.0)) for k, v in model.items()}
            g["b2"] = None if t == 1 else g["b2"]
            state, x = f(state, x, g)
        return state, x

    got_state, got = run("all")
    assert any(m is not None for ms in seen for m in ms)          # member by member
    seen.clear()
    want_state, want = run("0")
    assert all(m is None for ms in seen for m in ms)               # on the stack
    _close(got, want)
    _close(optim.state_dict(got_state), optim.state_dict(want_state))


def test_frozen_and_skipped_members_of_a_group_keep_their_state_bitwise(monkeypatch):
    model = _model()
    state, x = _run(RULES["Adam"], "all", monkeypatch, steps=2, freeze="w2")
    fresh = optim.setup(optim.Adam(1e-2), model)
    for a, b in zip(jax.tree.leaves(state["w2"].state), jax.tree.leaves(fresh["w2"].state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(x["w2"]), np.asarray(model["w2"]))
    # w3 had no gradient at step 1: one step taken, the products of its β's are β once
    np.testing.assert_allclose(np.asarray(state["w3"].state.bt), [0.9, 0.999], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state["w4"].state.bt), [0.81, 0.999 ** 2], rtol=1e-6)


@pytest.mark.parametrize("rule, reads", [
    (optim.Adam(), False), (optim.Lion(), False), (optim.chain(optim.ClipGlobalNorm(1.0), optim.Adam()), False),
    (optim.SkipNonFinite(optim.Adam()), False), (optim.AdamW(weight_decay=0.1), False),
    (optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(weight_decay=0.1)), False),
    (optim.MixedPrecision(optim.Adam()), False),                         # it steps its master copy
    (optim.EMA(optim.AdamW(weight_decay=0.1)), False),   # its state averages the new parameter, elementwise
    (optim.EMA(optim.Adam()), False),                     # ... read where the new parameter is computed
    (optim.chain(optim.WeightDecay(0.1), optim.Adam()), True),   # Adam's moments read λ x, and its step them
    (optim.SkipNonFinite(optim.AdamW(weight_decay=0.1)), False),         # inside the platform's conditional
    (optim.Lamb(), False),                                               # its step reads ‖x‖, its state not
    (_Normed(), True),                                                   # its state reads ‖x‖
    (_Branching(), True)])                                               # a conditional of its own reads x
def test_which_rules_are_grouped(rule, reads, monkeypatch):
    """A rule is grouped unless its new state reads the parameter other than elementwise or where its step reads
    that state too, or its step reads it inside a conditional of its own: such a read would go through the
    stack's concatenation, and XLA then copies every new parameter or state instead of writing it in place
    (optim._engine.group, optim._engine.members)."""
    assert _group.reads_parameter(rule) is reads
    monkeypatch.setattr(_group, "MODE", "all")
    state = optim.setup(rule, _model())
    big = [u for u, p in enumerate(state.layout.params) if p.shape == BIG]
    together = any(len(set(s) & set(big)) > 1 for s in state.layout.stacks)
    assert together is not reads


def _big_stacks(rule) -> list[int]:
    state = optim.setup(rule, _model())
    return [len(s) for s in state.layout.stacks if state.layout.params[s[0]].shape == BIG]


def test_groups_are_bounded_in_elements(monkeypatch):
    monkeypatch.setattr(_group, "MODE", "all")
    monkeypatch.setattr(_stack, "GROUP_MAX_ELEMENTS", 25_000)   # two of 10000 elements, not three
    assert _big_stacks(optim.Lion()) == [2, 2, 2]
    monkeypatch.setattr(_stack, "GROUP_MAX_ELEMENTS", 40_000)   # four, then what is left
    assert _big_stacks(optim.Lion()) == [4, 2]


@pytest.mark.parametrize("rule", [optim.Adam(), optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW())],
                         ids=["Adam", "clip+AdamW"])
def test_groups_stepped_in_one_kernel_are_smaller_and_equal(rule, monkeypatch):
    """A float32 Adam's group steps in one kernel on a GPU (optim._engine.multitensor), whose compile grows with
    its members: its bound is ONE_KERNEL_MAX_ELEMENTS, and its groups are as equal as their count allows, so that
    they share one kernel."""
    monkeypatch.setattr(_group, "MODE", "all")
    monkeypatch.setattr(_stack, "GROUP_MAX_ELEMENTS", 1 << 24)
    monkeypatch.setattr(_stack, "ONE_KERNEL_MAX_ELEMENTS", 40_000)
    assert _big_stacks(rule) == [3, 3]
    assert _big_stacks(optim.Adam(mu_dtype=jnp.bfloat16)) == [6]     # XLA's path: GROUP_MAX_ELEMENTS
    monkeypatch.setattr(onepass, "ENABLED", False)
    assert _big_stacks(rule) == [6]


def test_off_and_default_on_a_cpu_only_process(monkeypatch):
    """`OPTIM_GROUP=0` turns grouping off; unset, it is on only where JAX has a GPU or TPU backend."""
    for mode in ("0", "1"):
        monkeypatch.setattr(_group, "MODE", mode)
        state = optim.setup(optim.Adam(), _model())
        assert all(len(s) == 1 for s in state.layout.stacks if state.layout.params[s[0]].shape == BIG)


def test_adjust_on_a_grouped_state_does_not_recompile(monkeypatch):
    monkeypatch.setattr(_group, "MODE", "all")
    step, traces = counted_update()
    model = _model()
    state = optim.setup(optim.Adam(1e-2), model)
    state, x = step(state, model, _grads(model, 0))
    state = optim.adjust(state, lr=1e-3, beta=(0.8, 0.99))
    state, x = step(state, x, _grads(model, 0))
    assert len(traces) == 1


@pytest.mark.parametrize("save_mode, load_mode", [("all", "0"), ("0", "all")])
def test_a_checkpoint_moves_between_grouped_and_ungrouped_layouts(save_mode, load_mode, monkeypatch, tmp_path):
    state, x = _run(RULES["clip+Adam"], save_mode, monkeypatch, steps=2)
    optim.save(tmp_path / "c.npz", state, x)
    monkeypatch.setattr(_group, "MODE", load_mode)
    model = _model()
    like = optim.setup(RULES["clip+Adam"](), model)
    loaded, lx = optim.load(tmp_path / "c.npz", like=(like, model))
    assert len(loaded.layout.stacks) != len(state.layout.stacks)
    g = _grads(model, 5)
    a = optim.update(state, x, g)
    b = optim.update(loaded, lx, g)
    _close(a[1], b[1])
    _close(optim.state_dict(a[0]), optim.state_dict(b[0]))


def test_grouped_program_has_fewer_kernels(monkeypatch):
    """Structure, not time: on XLA:CPU the grouped Adam step has one fused loop fewer per parameter (the moments
    of a group are one loop); on XLA:GPU the new parameters are one kernel too (`python -m bench.kernels`)."""
    def fusions(mode):
        monkeypatch.setattr(_group, "MODE", mode)
        model = {f"w{i}": jnp.ones(BIG) for i in range(12)}
        state = optim.setup(optim.Adam(1e-3), model)
        text = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1)).lower(
            state, model, model).compile().as_text()
        return len(re.findall(r"= \S+ fusion\(", text[text.index("ENTRY"):]))

    alone, grouped = fusions("0"), fusions("all")     # XLA:CPU: 41 and 20 (its new parameters are 12 loops)
    assert alone >= 12 * 3 and grouped <= alone - 12, (alone, grouped)


@pytest.mark.parametrize("rule", [optim.Adam(1e-3), optim.AdamW(1e-3, weight_decay=0.1),
                                  optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, weight_decay=0.1))],
                         ids=["Adam", "AdamW", "clip+AdamW"])
def test_grouped_step_writes_the_parameters_in_place(rule, monkeypatch):
    """A donated grouped step has no parameter-sized copy on XLA:CPU: the new parameters are written into their
    buffers. (XLA:GPU copied every new parameter of a grouped AdamW until its step was computed per member,
    optim._engine.members; that is checked on the deviceless GPU compile, tests/test_gpu_kernels.py.)"""
    monkeypatch.setattr(_group, "MODE", "all")
    stacks, entry = _donated_step(rule, 6)
    assert stacks == 1
    assert not re.findall(r"f32\[100,100\]\{[0-9,]*\} copy\(", entry), entry


def _donated_step(rule, n: int) -> tuple[int, str]:
    """The number of stacks of `rule` on `n` parameters of shape BIG, and the ENTRY computation of its donated
    jitted step compiled for XLA:CPU."""
    model = {f"w{i}": jnp.ones(BIG) for i in range(n)}
    state = optim.setup(rule, model)
    text = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1)).lower(
        state, model, model).compile().as_text()
    return len(state.layout.stacks), text[text.index("ENTRY"):]



@pytest.mark.parametrize("name", ["SkipNonFinite(AdamW)", "SkipNonFinite(EMA(clip+AdamW))"])
@pytest.mark.parametrize("branch", ["cpu", "default"])
def test_a_grouped_skip_of_a_step_that_reads_the_parameter(branch, name, monkeypatch):
    """`SkipNonFinite(AdamW)` is grouped: its step, inside the platform's conditional (a conditional on CPU,
    selects elsewhere), is computed per member in each branch (optim._engine.members). "default" runs the other
    platforms' branch on the CPU (`platform_dependent` told to take it everywhere); there an EMA inside averages
    the gated new value (`EMA.apply_tree`'s `ok`). A NaN gradient skips the whole step, grouped or not;
    otherwise grouped and one parameter a stack agree, and the two branches agree."""
    make = RULES[name]

    def run(mode, branch=branch):
        monkeypatch.setattr(_group, "MODE", mode)
        take = jax.lax.platform_dependent
        if branch == "default":
            monkeypatch.setattr(jax.lax, "platform_dependent",
                                lambda *a, cpu=None, default=None, **k: take(*a, cpu=default, default=default))
        model = _model()
        state = optim.setup(make(), model)
        f = jax.jit(lambda s, m, g: optim.update(s, m, g))
        x, out = model, []
        for t in range(3):
            g = _grads(model, t)
            if t == 1:
                g["w4"] = g["w4"].at[0, 0].set(jnp.nan)
            state, x = f(state, x, g)
            out.append(x)
        monkeypatch.setattr(jax.lax, "platform_dependent", take)
        return state, out

    got_state, got = run("all")
    want_state, want = run("0")
    assert len(got_state.layout.stacks) < len(want_state.layout.stacks)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):      # step 1 skipped: nothing moved
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(got_state["w0"].state.skipped) == 1
    _close(got, want)
    _close(optim.state_dict(got_state), optim.state_dict(want_state))
    if branch == "default":
        cpu_state, on_cpu = run("all", "cpu")
        _close(got, on_cpu)
        _close(optim.state_dict(got_state), optim.state_dict(cpu_state))


@pytest.mark.parametrize("rule", [optim.AdamW(1e-3, weight_decay=0.1), optim.EMA(optim.AdamW(1e-3), 0.9),
                                  optim.SkipNonFinite(optim.AdamW(1e-3, weight_decay=0.1))],
                         ids=["AdamW", "EMA(AdamW)", "SkipNonFinite(AdamW)"])
def test_a_lone_large_parameter_is_written_in_place(rule, monkeypatch):
    """Issue 38's "no avoidable copy": a large parameter alone in its stack (grouping off, the CPU's default) was
    read through its stack of one (a reshape) where its step reads it, and XLA:CPU copied each new parameter
    out of the kernel that computes it; that arithmetic is now computed on the parameter's own array."""
    monkeypatch.setattr(_group, "MODE", "0")
    stacks, entry = _donated_step(rule, 3)
    assert stacks == 3
    assert not re.findall(r"f32\[(?:1,)?100,100\]\{[0-9,]*\} copy\(", entry), entry
