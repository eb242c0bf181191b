"""The matrix rules' per-matrix work split across 8 simulated CPU devices (run by tests/test_split_matrices.py).

Run as a script (`python tests/split_cases.py OUT.json`): it sets XLA_FLAGS before JAX starts, trains models of
same-shaped matrices with each matrix rule on one device and on a mesh of 8 (replicated parameters in a
sharded `jit`, ZeRO-1 and FSDP on Auto and on Explicit axes, inside `shard_map`, and the sharded step under
`vmap`, `jax.export` and `grad`), and writes one JSON record per
case: `{"ok": bool, "error": str, ...measurements}`. Each record holds the largest difference from the
single-device parameters and, from the per-device compiled program (`compile().as_text()`), the matrix
products it does with the split on and with it off (`optim._rules.split.ENABLED`).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# as in parallel_cases.py: more PJRT worker threads, so that 8 devices' collectives on 2 cores do not starve
os.environ.setdefault("PJRT_NPROC", str(max(32, os.cpu_count() or 1)))

import functools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optim  # noqa: E402
from optim._rules import split  # noqa: E402

N_DEV = 8
STEPS = 3
N = 16              # same-shaped matrices: 2 a device
SHAPE = (32, 48)
LARGE, N_LARGE = (96, 96), 3    # Muon: above the stacking size, stacked on a mesh; fewer than the devices

RULES = {
    "muon": lambda: optim.Muon(0.02, weight_decay=0.01),
    "normuon": lambda: optim.NorMuon(0.02),
    "shampoo": lambda: optim.Shampoo(1e-2, precondition_every=1, start_preconditioning_step=1),
    "kron": lambda: optim.Kron(1e-2),
    "soap": lambda: optim.SOAP(1e-2, precondition_frequency=1),
}


def make_model(rule: str) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), N + N_LARGE)
    model = {f"w{i:02d}": jax.random.normal(keys[i], SHAPE) for i in range(N)}
    if rule == "muon":
        model.update({f"big{i}": jax.random.normal(keys[N + i], LARGE) / 10 for i in range(N_LARGE)})
    return model


def gradients(model: dict) -> list:
    return [jax.tree.map(lambda a, k=k: jnp.sin(a * (k + 1)) + 0.1 * a, model) for k in range(STEPS)]


def train(rule: str, model: dict, put=None, **setup) -> tuple[dict, str]:
    """The model after `STEPS` jitted steps, and the step's compiled per-device program. `put` places the model
    and the gradients (None: one device)."""
    put = put or (lambda t: t)
    model = put(model)
    state = optim.setup(RULES[rule](), model, **setup)
    step = jax.jit(lambda s, m, g: optim.update(s, m, g))
    grads = [put(g) for g in gradients(model)]
    text = step.lower(state, model, grads[0]).compile().as_text()
    for g in grads:
        state, model = step(state, model, g)
    return model, text


@functools.cache
def reference(rule: str) -> dict:
    """The model trained on one device."""
    return train(rule, make_model(rule))[0]


def products(text: str) -> dict:
    """Per-device matrix products of a compiled program: `dots` (each dot counted by its batch size, the
    leading dimensions of its 3-d or larger output) and `loops`, the trip counts of its while loops (Shampoo's
    and Kron's members are stepped one at a time)."""
    dots = 0
    for shape in re.findall(r"= f32\[([\d,]*)\]\{[\d,]*\} dot\(", text):
        dims = [int(d) for d in shape.split(",") if d]
        dots += int(np.prod(dims[:-2])) if len(dims) > 2 else 1
    return {"dots": dots, "loops": sorted(int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', text))}


def difference(got: dict, ref: dict) -> dict:
    """The largest absolute difference from the single-device parameters, and whether every parameter is
    within rtol 1e-5 (atol 1e-6) of them."""
    pairs = [(np.asarray(got[k]), np.asarray(ref[k])) for k in ref]
    return {"max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
            "close": all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)}


def case(rule: str, kind: str) -> dict:
    """`rule` trained on 8 devices in the style `kind`, against one device; the per-device program's products
    with the split on and off."""
    model, ref = make_model(rule), reference(rule)
    explicit = kind.endswith("explicit")
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit if explicit else AxisType.Auto,))
    rep = NamedSharding(mesh, P())
    put = (lambda t: jax.device_put(t, rep))
    setup = {}
    if kind.startswith("zero1"):
        setup["state_sharding"] = lambda path, x: NamedSharding(mesh, P("data"))
    elif kind.startswith("fsdp"):
        put = (lambda t: jax.device_put(t, NamedSharding(mesh, P("data"))))
    out = {}
    for on in (True, False):
        split.ENABLED = on
        try:
            if explicit:
                with jax.set_mesh(mesh):
                    got, text = train(rule, model, put, **setup)
            else:
                got, text = train(rule, model, put, **setup)
        finally:
            split.ENABLED = True
        out["on" if on else "off"] = {**difference(got, ref), **products(text)}
    return out


def case_shard_map(rule: str) -> dict:
    """Inside a user's `shard_map` each device steps its own copy of the parameters: nothing to split."""
    model, ref = make_model(rule), reference(rule)
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))
    model_r = jax.device_put(model, NamedSharding(mesh, P()))
    state = optim.setup(RULES[rule](), model_r)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P(), out_specs=P())
    def step(state, model, g):
        return optim.update(state, model, g)

    for g in gradients(model):
        state, model_r = step(state, model_r, jax.device_put(g, NamedSharding(mesh, P())))
    return {"on": difference(model_r, ref)}


def case_transformed(rule: str) -> dict:
    """The split step (replicated parameters on the mesh) under the transformations a user applies to `update`:
    `jax.vmap` over two models at once, `jax.export` and back, and a derivative through a step (the loss after
    one step, by the learning rate: `jax.grad` of `update`'s output). Each against the same transformation on one
    device, where nothing is split; `dots` is the vmapped per-device program's products (split: the batch of 2
    times 1/8 of them)."""
    model = make_model(rule)
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Auto,))
    rep = NamedSharding(mesh, P())
    put = (lambda t: jax.device_put(t, rep))
    g = gradients(model)[0]
    twice = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a]), model)
    g2 = jax.tree.map(lambda a: jnp.stack([a, -a]), g)

    def vmapped(put):
        states = [optim.setup(RULES[rule](), put(jax.tree.map(lambda a, i=i: a[i], twice))) for i in range(2)]
        state = jax.tree.map(lambda a, b: jnp.stack([a, b]), *states)
        step = jax.jit(jax.vmap(lambda s, m, d: optim.update(s, m, d)))
        text = step.lower(state, put(twice), put(g2)).compile().as_text()
        return step(state, put(twice), put(g2))[1], text

    def exported(put):
        state, m = optim.setup(RULES[rule](), put(model)), put(model)
        step = jax.jit(lambda s, m, d: optim.update(s, m, d))
        exp = jax.export.export(step)(state, m, put(g))
        return exp.call(state, m, put(g))[1]

    def derivative(put):
        m = put(model)

        def loss(lr):
            state = optim.adjust(optim.setup(RULES[rule](), m), lr=lr)
            new = optim.update(state, m, put(g))[1]
            return sum(jnp.sum(v ** 2) for v in jax.tree.leaves(new))
        return {"d": jax.jit(jax.grad(loss))(jnp.float32(0.02))}

    out = {}
    one_v, _ = vmapped(lambda t: t)
    got_v, text = vmapped(put)
    out["vmap"] = {**difference(got_v, one_v), **products(text)}
    out["export"] = difference(exported(put), exported(lambda t: t))
    out["grad"] = difference(derivative(put), derivative(lambda t: t))
    return out


def main(out_path: str, only: str = "") -> None:
    assert jax.device_count() == N_DEV, jax.devices()
    cases = [(f"{r}_{k}", (lambda r=r, k=k: case(r, k)))
             for r in RULES for k in ("replicated", "zero1_auto", "zero1_explicit")]
    cases += [(f"muon_{k}", lambda k=k: case("muon", k)) for k in ("fsdp", "fsdp_explicit")]
    cases += [("muon_shard_map", lambda: case_shard_map("muon"))]
    cases += [("muon_transformed", lambda: case_transformed("muon"))]
    results = {}
    for name, fn in [c for c in cases if not only or c[0] in only.split(",")]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            rec = fn()
            rec["ok"] = True
        except Exception as e:  # recorded, asserted on by the pytest side
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["cpu_seconds"] = round(time.process_time() - c0, 2)
        results[name] = rec
        print(name, json.dumps(rec)[:400], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
