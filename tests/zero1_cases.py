"""ZeRO-1 with optim on 8 simulated CPU devices: replicated parameters, optimiser state sharded over the data axis
(`setup(rule, model, state_sharding=fn)`). Run by tests/test_zero1.py.

Run as a script (`python tests/zero1_cases.py OUT.json`). Like `parallel_cases.py` (whose model, rule, batches,
reference and comparison it reuses; importing it sets XLA_FLAGS before JAX starts), it writes one JSON record
per case, `{"ok": bool, "error": str, ...measurements}`, and the pytest side asserts on the records.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parallel_cases as pc  # noqa: E402  (first: sets XLA_FLAGS before JAX starts)

import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optim  # noqa: E402
from rule_cases import classes_in, table  # noqa: E402

N_DEV = pc.N_DEV
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collectives(hlo: str) -> dict:
    """How many instructions of each collective kind a compiled HLO module has (async pairs count once), and
    each one's result type: `{"all-gather": 3, ..., "ops": ["all-gather f32[16,8]", ...]}`."""
    out: dict = {k: 0 for k in COLLECTIVES}
    ops = []
    for line in hlo.splitlines():
        m = re.search(rf"= (.*?) ({'|'.join(COLLECTIVES)})(?:-start)?\(", line)
        if m:
            out[m.group(2)] += 1
            ops.append(f"{m.group(2)} {re.sub(r'{[^}]*}', '', m.group(1))}")
    out["ops"] = sorted(ops)
    return out


def zero1(mesh):
    """The ZeRO-1 state sharding: a parameter's state split on its first axis over `data` where that divides."""
    def fn(path, x):
        return NamedSharding(mesh, P("data")) if x.ndim and x.shape[0] % N_DEV == 0 else None
    return fn


def shard_report(state, model) -> tuple[dict, list[str]]:
    """Per canonical path: the spec of each state array of the parameter's shape and its addressable shard
    shapes; and the problems: a sharded array whose 8 shards are not 1/8 of it on axis 0."""
    flat = dict(optim.trainables(model, path=True))
    out, bad = {}, []
    for path, leaf in state.items():
        x = flat[path]
        rows = []
        for a in jax.tree.leaves(leaf.state):
            if a.shape != x.shape:
                rows.append({"shape": list(a.shape), "spec": spec(a), "replicated":
                             bool(a.sharding.is_fully_replicated)})
                continue
            shards = sorted({tuple(s.data.shape) for s in a.addressable_shards})
            rows.append({"shape": list(a.shape), "spec": spec(a),
                         "shards": [list(s) for s in shards], "n_shards": len(a.addressable_shards)})
        out[path] = rows
    return out, bad


def stack_report(state) -> list[dict]:
    """Per stack: its members' canonical paths and each state array's shape, spec and shard shape."""
    lay = state.layout
    out = []
    for g, members in enumerate(lay.stacks):
        out.append({"members": [lay.paths[lay.params[u].canonical] for u in members],
                    "arrays": [{"shape": list(a.shape), "spec": spec(a),
                                "shard": list(a.addressable_shards[0].data.shape)}
                               for a in jax.tree.leaves(state.stacks[g])]})
    return out


def expected_specs(state) -> list[str]:
    """What every stack array's spec should be, from the layout: P(None, *spec) for the arrays of the parameters'
    shape in a stack with a requested state sharding, P() for the rest (the models here are replicated)."""
    lay, out = state.layout, []
    for g, stack in enumerate(lay.stacks):
        p = lay.params[stack[0]]
        for a in jax.tree.leaves(state.stacks[g]):
            if p.state_place is not None and tuple(a.shape[1:]) == p.shape:
                parts = [None, *p.state_place.spec]
                while parts and parts[-1] is None:
                    parts.pop()
                out.append(str(P(*parts)))
            else:
                out.append(str(P()))
    return out


def placed_ok(state) -> bool:
    return specs_of(state) == expected_specs(state)


def spec(a) -> str:
    """An array's PartitionSpec without trailing Nones (P(None, 'data', None) and P(None, 'data') are one)."""
    parts = list(a.sharding.spec)
    while parts and parts[-1] is None:
        parts.pop()
    return str(P(*parts))


def specs_of(state) -> list[str]:
    return [spec(a) for a in jax.tree.leaves(state.stacks)]


def compare(state, model, ref) -> dict:
    """`parallel_cases.compare` by path (`state_dict`): the layouts differ (the ZeRO-1 one records shardings)."""
    ref_state, ref_model = ref
    worst = 0.0
    for name, a, b in [("model", model, ref_model), ("state", optim.state_dict(state), optim.state_dict(ref_state))]:
        assert jax.tree.structure(a) == jax.tree.structure(b), name
        for x, y in zip(pc.to_host(a), pc.to_host(b)):
            np.testing.assert_allclose(x, y, rtol=pc.RTOL, atol=pc.ATOL, err_msg=name)
            if x.dtype.kind == "f" and x.size:
                worst = max(worst, float(np.max(np.abs(x - y))))
    tied = bool(np.array_equal(np.asarray(model["emb"]), np.asarray(model["head"])))
    assert tied, "tied positions emb / head differ after training"
    moved = float(np.max(np.abs(np.asarray(model["emb"]) - np.asarray(pc.make_model()["emb"]))))
    assert moved > 1e-3, "the parameters hardly moved: the comparison would be vacuous"
    return {"max_abs_diff": worst, "tied": tied, "step": int(state.step)}


def replicated_model(mesh, model):
    return pc.tie_preserving_put(model, jax.tree.map(lambda _: NamedSharding(mesh, P()), model))


# ------------------------------------------------------------------------------------------- 1. ZeRO-1 jit
def case_zero1_jit(ref, axis_type) -> dict:
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(axis_type,))
    model = replicated_model(mesh, pc.make_model())
    state = optim.setup(pc.make_rule(), model, state_sharding=zero1(mesh))
    want = specs_of(state)
    by_batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(state, model, batch):
        return optim.update(state, model, jax.grad(pc.loss_fn)(model, batch))

    batch0 = jax.device_put(pc.batches()[0], by_batch)
    step_hlo = step.lower(state, model, batch0).compile().as_text()
    grad_hlo = jax.jit(jax.grad(pc.loss_fn)).lower(model, batch0).compile().as_text()
    grads0 = jax.jit(jax.grad(pc.loss_fn))(model, batch0)
    update_hlo = jax.jit(optim.update).lower(state, model, grads0).compile().as_text()
    # the same step with replicated state, for comparison
    plain = optim.setup(pc.make_rule(), model)
    plain_hlo = step.lower(plain, model, batch0).compile().as_text()
    specs_per_step = []
    for i, b in enumerate(pc.batches()):
        state, model = step(state, model, jax.device_put(b, by_batch))
        specs_per_step.append(specs_of(state) == want)
        if i % pc.SYNC_EVERY == 0:
            jax.block_until_ready(model)
    out = compare(state, model, ref)
    out["compiles"] = pc.compiles_of_fresh_state(mesh, state_sharding=zero1(mesh))
    assert all(specs_per_step), f"the state left its sharding: {specs_of(state)} vs {want}"
    params_replicated = all(x.sharding.is_fully_replicated for _, x in optim.trainables(model, path=True))
    assert params_replicated, "the parameters left their replicated placement"
    assert model["emb"] is model["head"] or np.array_equal(model["emb"], model["head"])
    shards, _ = shard_report(state, model)
    out.update(state_specs=want, state_specs_kept=all(specs_per_step), params_replicated=params_replicated,
               shards=shards, stacks=stack_report(state),
               step_collectives=collectives(step_hlo), grad_collectives=collectives(grad_hlo),
               update_collectives=collectives(update_hlo), replicated_state_step_collectives=collectives(plain_hlo))
    return out


# ------------------------------------------------------------------------------------------- 2. eager update
def case_zero1_eager(ref) -> dict:
    """`optim.update` called eagerly (its own jit) with the sharded state, and the state-surgery functions."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    model = replicated_model(mesh, pc.make_model())
    state = optim.setup(pc.make_rule(), model, state_sharding=zero1(mesh))
    want = specs_of(state)
    by_batch = NamedSharding(mesh, P("data"))
    grad = jax.jit(jax.grad(pc.loss_fn))
    kept = []
    for i, b in enumerate(pc.batches()):
        state, model = optim.update(state, model, grad(model, jax.device_put(b, by_batch)))
        kept.append(specs_of(state) == want)
        if i % pc.SYNC_EVERY == 0:
            jax.block_until_ready(model)
    out = compare(state, model, ref)
    assert all(kept), f"eager update moved the state: {specs_of(state)} vs {want}"
    assert model["emb"] is model["head"], "eager update untied emb / head"
    assert all(x.sharding.is_fully_replicated for _, x in optim.trainables(model, path=True))
    out["state_specs_kept"] = True
    g = grad(model, jax.device_put(pc.batches()[0], by_batch))

    # state_dict -> load_state_dict onto a fresh sharded like-state: the shardings come back
    tree = optim.state_dict(state)
    like = optim.setup(pc.make_rule(), model, state_sharding=zero1(mesh))
    back = optim.load_state_dict(like, tree)
    out["state_dict_roundtrip_specs"] = specs_of(back) == want
    assert out["state_dict_roundtrip_specs"], specs_of(back)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)))
    # a host copy of the dict (what a plain checkpoint gives back): the first update puts the state in place
    host = jax.tree.map(np.asarray, tree)
    back2, _ = optim.update(optim.load_state_dict(like, host), model, g)
    out["host_state_dict_then_update_specs"] = specs_of(back2) == want
    assert out["host_state_dict_then_update_specs"], specs_of(back2)

    # freeze (same stacks), reset, save / load
    checks = {}
    frozen = optim.freeze(state, "mlp")
    s2, _ = optim.update(frozen, model, g)
    checks["freeze"] = specs_of(frozen) == want and specs_of(s2) == want
    r = optim.reset(state, "mlp.b")
    checks["reset"] = specs_of(r) == want and not np.asarray(r["mlp.b"].state[1][0]).any()
    with tempfile.TemporaryDirectory() as d:
        optim.save(os.path.join(d, "ckpt.npz"), state, model)
        loaded, lmodel = optim.load(os.path.join(d, "ckpt.npz"), like=(like, model))
    checks["save_load_values"] = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded),
                                                                            jax.tree.leaves(state)))
    checks["save_load_specs"] = specs_of(loaded) == want
    s4, m4 = optim.update(loaded, lmodel, g)
    checks["save_load_update_specs"] = specs_of(s4) == want
    checks["save_load_update_params_replicated"] = all(x.sharding.is_fully_replicated for x in jax.tree.leaves(m4))
    # informational: optim.load rebuilds the layout's Params without the requested state sharding (see report)
    checks["save_load_layout_keeps_state_sharding"] = loaded.layout == like.layout
    out["surgery"] = checks
    return out


# ------------------------------------------------------------------------------------------- 3. stacks
LAYERS = 3


def make_deep(seed: int = 0) -> dict:
    """The tied model with three more same-shaped (8, 8) layers and biases: stacked together by optim."""
    model = pc.make_model(seed)
    k = jax.random.split(jax.random.key(seed + 1), LAYERS)
    model["layers"] = [{"w": jax.random.normal(k[i], (pc.DIM, pc.DIM)) * 0.3, "b": jnp.zeros(pc.DIM)}
                       for i in range(LAYERS)]
    return model


def deep_loss(model, batch):
    x = jax.nn.one_hot(batch["tok"], pc.VOCAB) @ model["emb"]
    for layer in model["layers"]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    h = jnp.tanh(x @ model["mlp"]["w"] + model["mlp"]["b"]) * model["gain"]
    logp = jax.nn.log_softmax(h @ model["head"].T)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["tgt"], pc.VOCAB), axis=-1))


def deep_step(state, model, batch):
    return optim.update(state, model, jax.grad(deep_loss)(model, batch))


_DEEP_REF: list = []


def deep_reference() -> tuple:
    """Single-device training of the deep model on the whole batch (computed once)."""
    if not _DEEP_REF:
        model = make_deep()
        state = optim.setup(pc.make_rule(), model)
        step = jax.jit(deep_step)
        for b in pc.batches():
            state, model = step(state, model, b)
        _DEEP_REF.append(jax.block_until_ready((state, model)))
    return _DEEP_REF[0]


def train_deep(state, model, mesh, steps=None) -> tuple:
    """Train with a jitted step; the state must stay where its layout says after every step."""
    by_batch = NamedSharding(mesh, P("data"))
    step = jax.jit(deep_step)
    for i, b in enumerate(pc.batches()[:steps]):
        state, model = step(state, model, jax.device_put(b, by_batch))
        assert placed_ok(state), f"step {i}: {specs_of(state)} vs {expected_specs(state)}"
        if i % pc.SYNC_EVERY == 0:
            jax.block_until_ready(model)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(model)), "parameters left replication"
    return state, model


def case_zero1_stacked(_ref) -> dict:
    """Several same-shaped parameters in one stack with sharded moments: the stack is sharded on the
    parameters' axes, P(None, 'data'); then a per-path adjust that splits the stack keeps every piece sharded."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    model = replicated_model(mesh, make_deep())
    state = optim.setup(pc.make_rule(), model, state_sharding=zero1(mesh))
    lay = state.layout
    members = [[lay.paths[lay.params[u].canonical] for u in g] for g in lay.stacks if len(g) > 1]
    assert placed_ok(state), specs_of(state)
    batch0 = jax.device_put(pc.batches()[0], NamedSharding(mesh, P("data")))
    hlo = jax.jit(deep_step).lower(state, model, batch0).compile().as_text()
    state, model = train_deep(state, model, mesh)
    out = compare(state, model, deep_reference())

    # adjust by path splits the (8, 8) stack (layers.0.w gets a rule of its own): each piece stays sharded,
    # on setup's placement and after a step; freeze keeps the stacks and their placement. (The chain's
    # ClipGlobalNorm looks across parameters, so adjust refuses to split it: the split is checked on AdamW alone.)
    per_param = optim.setup(pc.make_rule().rules[1], model, state_sharding=zero1(mesh))
    adjusted = optim.adjust(per_param, "layers.0.w", lr=1e-3)
    split = adjusted.layout.stacks != per_param.layout.stacks
    s2, m2 = train_deep(adjusted, model, mesh, steps=2)
    frozen = optim.freeze(state, "layers.1")
    s3, _ = train_deep(frozen, model, mesh, steps=1)
    thawed = optim.thaw(s3, "layers.1")
    out.update(stacked_members=members, stacks=stack_report(state), step_collectives=collectives(hlo),
               adjust_split_stack=split, adjust_placed=placed_ok(adjusted), adjust_after_steps_placed=placed_ok(s2),
               adjusted_stacks=stack_report(adjusted), freeze_placed=placed_ok(frozen) and placed_ok(thawed))
    return out


def case_zero1_mixed_specs(_ref) -> dict:
    """Same-shaped parameters whose state shardings differ are stacked apart, each stack sharded as its members
    asked: layers.0.w on rows, layers.1.w on columns, layers.2.w and mlp.w as the parameter (replicated)."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    model = replicated_model(mesh, make_deep())
    choice = {"layers.0.w": P("data"), "layers.1.w": P(None, "data")}

    def fn(path, x):
        spec = choice.get(path)
        return NamedSharding(mesh, spec) if spec is not None else None

    state = optim.setup(pc.make_rule(), model, state_sharding=fn)
    lay = state.layout
    stack_of = {lay.paths[lay.params[u].canonical]: g for g, stack in enumerate(lay.stacks) for u in stack}
    apart = len({stack_of[f"layers.{i}.w"] for i in range(LAYERS)}) == LAYERS
    together = stack_of["layers.2.w"] == stack_of["mlp.w"]
    assert placed_ok(state), specs_of(state)
    state, model = train_deep(state, model, mesh)
    out = compare(state, model, deep_reference())
    m = {p: state[p].state[1][0] for p in ("layers.0.w", "layers.1.w", "layers.2.w")}     # AdamW's m
    return out | {"apart": apart, "unsharded_together": together, "specs": {p: spec(a) for p, a in m.items()},
                  "shards": {p: sorted({tuple(s.data.shape) for s in a.addressable_shards}) for p, a in m.items()},
                  "stacks": stack_report(state)}


def case_zero1_errors(_ref) -> dict:
    """A sharding that does not divide the parameter's shape: a ValueError naming the path, from setup, before
    any state is made (JAX refuses uneven shards for arrays it places: device_put, jit out_shardings)."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    model = replicated_model(mesh, {"w": jnp.ones((12, 8)), "v": jnp.ones((16, 8))})
    try:
        optim.setup(optim.Adam(0.1), model, state_sharding=lambda p, x: NamedSharding(mesh, P("data")))
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("setup accepted P('data') over 8 devices for a (12, 8) parameter")
    return {"tied": True, "step": 6, "max_abs_diff": 0.0, "error_type": "ValueError", "message": message,
            "devices": device_errors(mesh)}


def device_errors(mesh) -> dict:
    """State shardings on other devices than the parameter's: per case, setup's ValueError message (or "accepted"
    and whether a first update then runs, for the placements that are allowed)."""
    devs = jax.devices()
    on0 = {"enc": {"w": jax.device_put(jnp.ones((8, 4)), devs[0])}}
    everywhere = replicated_model(mesh, {"enc": {"w": jnp.ones((8, 4))}})
    half = jax.make_mesh((4,), ("data",), devices=devs[:4])
    other = jax.make_mesh((2, 4), ("a", "b"), devices=devs)      # another mesh over the same 8 devices
    cases = {"other_device": (on0, jax.sharding.SingleDeviceSharding(devs[3])),
             "sub_mesh": (everywhere, NamedSharding(half, P("data"))),
             "same_device": (on0, jax.sharding.SingleDeviceSharding(devs[0])),
             "uncommitted": ({"enc": {"w": np.ones((8, 4), np.float32)}}, NamedSharding(mesh, P("data"))),
             "same_devices_other_mesh": (everywhere, NamedSharding(other, P("a")))}
    out = {}
    for name, (model, s) in cases.items():
        try:
            state = optim.setup(optim.Adam(0.1), model, state_sharding=lambda p, x, s=s: s)
        except ValueError as e:
            out[name] = str(e)
            continue
        try:
            optim.update(state, model, jax.tree.map(jnp.ones_like, model))
            out[name] = "accepted, update ran"
        except Exception as e:  # recorded: an accepted sharding that update then refuses
            out[name] = f"accepted, update failed: {type(e).__name__}: {str(e)[:300]}"
    return out


# ------------------------------------------------------------------------------------------- 4. every rule
def every_rule() -> dict:
    """A rule per exported rule class (the stateless stages in chains), by the top-level key of the model: the
    registry's `zero1` cases (`rule_cases.py`: a new rule is one entry there)."""
    return {c.id: c.make() for c in table("zero1")}


def rule_classes(rule) -> set[str]:
    """The class names of `rule` and of the rules inside it (chains, wrappers)."""
    return {c.__name__ for c in classes_in(rule)}


def case_zero1_every_rule(_ref) -> dict:
    """Every rule optim exports, with `state_sharding=zero1` on a mesh with Explicit axes and on one with Auto
    axes, `update` eager and inside `jit`, 2 steps, against the same training unsharded on one device. All rules
    train one model, each its own tied (16, 8) matrix through `by_path` (one compiled program per run): the
    matrix is what Muon needs and what Adafactor factors, and ZeRO-1 splits its state's rows 8 ways."""
    rules = every_rule()
    exported = {n for n in optim.__all__ if n != "Rule" and isinstance(getattr(optim, n), type)
                and hasattr(getattr(optim, n), "init") and hasattr(getattr(optim, n), "apply")}
    rule = optim.by_path(rules)
    k = jax.random.split(jax.random.key(0), len(rules))
    models = {name: {"w": w, "head": w} for name, w in zip(rules, (jax.random.normal(a, (16, 8)) for a in k))}
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), models) for _ in range(2)]
    # committed to the device like every later state, so that the second step does not compile again
    ref_state, ref_model = jax.device_put(optim.setup(rule, models)), models
    for g in grads:
        ref_state, ref_model = optim.update(ref_state, ref_model, g)
    ref = optim.state_dict(ref_state)["params"]
    worst, runs = {}, []
    for kind in ("Explicit", "Auto"):
        mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(getattr(jax.sharding.AxisType, kind),))
        model0 = replicated_model(mesh, models)
        state0 = optim.setup(rule, model0, state_sharding=zero1(mesh))
        want = specs_of(state0)
        gs = [jax.device_put(g, NamedSharding(mesh, P())) for g in grads]
        # the first step eager for both runs (compiled once), the second eager or inside jit: 2 steps (AccumGrad
        # steps on the second, Rprop compares signs), each program compiled once
        first = optim.update(state0, model0, gs[0])
        for how, update in (("eager", optim.update), ("jit", jax.jit(optim.update))):
            state, model = update(*first, gs[1])
            assert specs_of(state) == want, f"{kind} axes, {how}: the state left its sharding"
            assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(model)), f"{kind} {how}: params"
            got = optim.state_dict(state)["params"]
            for name in rules:
                a, b = (pc.to_host(({p: v for p, v in sd.items() if p.split(".")[0] == name}, m[name]))
                        for sd, m in ((got, model), (ref, ref_model)))
                np.testing.assert_allclose(np.concatenate([x.ravel() for x in a]),
                                           np.concatenate([y.ravel() for y in b]), rtol=pc.RTOL, atol=pc.ATOL,
                                           err_msg=f"{name}, {kind} axes, {how}")
                worst[name] = max([worst.get(name, 0.0)] + [float(np.max(np.abs(x - y))) for x, y in zip(a, b)])
                assert model[name]["w"] is model[name]["head"] or np.array_equal(model[name]["w"], model[name]["head"])
            runs.append(f"{kind}_{how}")
    return {"tied": True, "step": 6, "max_abs_diff": max(worst.values()), "runs": runs, "worst": worst,
            "missing": sorted(exported - set().union(*map(rule_classes, rules.values())))}


def case_readme_zero1(_ref) -> dict:
    """The README's ZeRO-1 block, run as written on the tied model (with the README's `put`)."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    scope = {"jax": jax, "np": np, "optim": optim, "NamedSharding": NamedSharding, "P": P,
             "model": pc.make_model(), "rule": pc.make_rule(), "loss": pc.loss_fn, "batch": pc.batches()[0]}
    exec(next(b for b in blocks if "def put(" in b), scope)
    exec(next(b for b in blocks if "state_sharding=zero1" in b), scope)
    state, model = scope["state"], scope["model"]
    assert int(state.step) == 1 and np.array_equal(model["emb"], model["head"])
    m = state["emb"].state[1][0]        # AdamW's m (the chain's second rule)
    assert {tuple(s.data.shape) for s in m.addressable_shards} == {(2, 8)}, m.sharding
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(model))
    return {"tied": True, "step": 6, "max_abs_diff": 0.0}


def main(out_path: str) -> None:
    assert jax.device_count() == N_DEV, jax.devices()
    results = {}
    t0, c0 = time.perf_counter(), time.process_time()
    ref = pc.single_device()
    results["single_device"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2),
                                "cpu_seconds": round(time.process_time() - c0, 2)}
    cases = [("zero1_jit_explicit", lambda r: case_zero1_jit(r, jax.sharding.AxisType.Explicit)),
             ("zero1_jit_auto", lambda r: case_zero1_jit(r, jax.sharding.AxisType.Auto)),
             ("zero1_eager", case_zero1_eager), ("zero1_stacked", case_zero1_stacked),
             ("zero1_mixed_specs", case_zero1_mixed_specs), ("zero1_errors", case_zero1_errors),
             ("readme_zero1", case_readme_zero1), ("zero1_every_rule", case_zero1_every_rule)]
    pc.run_cases(cases, ref, results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
