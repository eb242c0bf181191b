"""`python -m bench.kernels [--json OUT]`: how many GPU kernels one jitted update step launches, without a GPU.

Method (issue 38): XLA's deviceless compile for an H100. `jax.experimental.topologies.get_topology_desc` builds
a CUDA device from a target description (`bench/gpu_specs/h100_sxm.txtpb`, XLA's `h100_sxm` GpuTargetConfigProto)
instead of a real GPU; the step is jitted, lowered on abstract arguments (`jax.ShapeDtypeStruct`s with a
`SingleDeviceSharding` on that device) and compiled by XLA:GPU's full pipeline (fusion, scheduling, and ptxas
from `nvidia-cuda-nvcc-cu12`). In the compiled module's ENTRY computation each `fusion` is one kernel, each
`custom-call` one library call (cuBLAS, cuDNN), each `copy` one copy kernel; anything else that is not free
(`parameter`, `constant`, `tuple`, `get-tuple-element`, `bitcast`) is listed as `other`. In this deviceless
compile each matmul comes out as a Triton gemm fusion (`kind=kCustom`, not a cuBLAS custom-call), counted in
`fusions` and apart as `gemms`. A `copy` with as many elements as one of ENTRY's array parameters (parameter,
gradient or state array) is a whole array copied per step (`param_copies`).

The steps: optim's `optim.update(state, params, grads)` and optax's `tx.update` + `optax.apply_updates`, both
`jax.jit(..., donate_argnums=(0, 1))` on `(state, params, grads)`; the state is set up on CPU arrays and made
abstract. optim's fused CPU kernel cannot appear: which code runs is chosen when the program is lowered
(optim._engine.kernel_choice), and a program lowered for CUDA gets XLA's code.

Needs jax, jaxlib, jax-cuda12-plugin and jax-cuda12-pjrt of one version, nvidia-cuda-nvcc-cu12, optax; no GPU.
`make gpu-kernels` installs them in `.venv-gpu` and runs this (JAX_PLATFORMS=cpu is set here when unset).
A CI test can import `count` and `workloads`. Muon on 1000 leaves is left out unless `--all`: each of its
programs has ~15 matmuls per leaf, and XLA:GPU's multi-output fusion pass takes 20 minutes and more on them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the CUDA target is deviceless: no GPU backend to start
# `setup` runs in this CPU-only process but builds the state a GPU process would: XLA's path grouping large
# parameters (optim._engine.group, on where there is a GPU) and not the fused CPU kernel's stacking of its rules.
os.environ.setdefault("OPTIM_GROUP", "all")
os.environ.setdefault("OPTIM_FUSED", "0")

import jax                # noqa: E402
import jax.numpy as jnp   # noqa: E402
import numpy as np        # noqa: E402

SPEC = Path(__file__).with_name("gpu_specs") / "h100_sxm.txtpb"
SIZES = {"100x400x400": (100, (400, 400)), "1000x128x128": (1000, (128, 128))}
SLOW = {("1000x128x128", "Muon")}      # left out unless --all (see above)
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_INSTR = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*)$")


def sharding() -> jax.sharding.Sharding:
    """A `SingleDeviceSharding` on the one device of a deviceless H100 topology."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise SystemExit("bench.kernels needs the CUDA plugin (no GPU needed): pip install jax-cuda12-plugin=="
                         f"{jax.__version__} jax-cuda12-pjrt=={jax.__version__} nvidia-cuda-nvcc-cu12, "
                         "or run `make gpu-kernels`") from None
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=SPEC.read_text(), topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def abstract(tree, where: jax.sharding.Sharding):
    """`tree` with each array replaced by a `ShapeDtypeStruct` placed by `where`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=where), tree)


def _split(rhs: str) -> tuple[str, str]:
    """`<shape> opcode(...)` -> (shape, opcode); a tuple shape is skipped by its balanced parentheses."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                shape, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
                break
    else:
        shape, _, rest = rhs.partition(" ")
    return shape, rest.partition("(")[0]


def _elements(shape: str) -> int | None:
    """Elements of an array shape (`f32[64,400,400]{2,1,0}`), None for a tuple or a scalar."""
    m = re.fullmatch(r"\w+\[([\d,]*)\](?:\{.*\})?", shape)
    return math.prod(int(d) for d in m.group(1).split(",")) if m and m.group(1) else None


def entry_kernels(hlo_text: str) -> dict:
    """Kernel counts of the ENTRY computation of a compiled GPU module's text (see the module docstring)."""
    ops, params, copies, gemms = [], set(), [], 0
    lines = iter(hlo_text.splitlines())
    for line in lines:
        if line.startswith("ENTRY "):
            break
    for line in lines:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if m:
            shape, op = _split(m.group(1))
            ops.append(op)
            gemms += op == "fusion" and "kind=kCustom" in m.group(1) and "gemm" in m.group(1)
            if op == "parameter" and _elements(shape):
                params.add(_elements(shape))
            elif op == "copy":
                copies.append(_elements(shape))
    other = sorted(op for op in ops if op not in FREE | {"fusion", "custom-call", "copy"})
    out = {"fusions": ops.count("fusion"), "gemms": gemms, "custom_calls": ops.count("custom-call"),
           "copies": len(copies), "param_copies": sum(n in params for n in copies), "other": len(other),
           "other_ops": sorted(set(other))}
    out["kernels"] = out["fusions"] + out["custom_calls"] + out["copies"] + out["other"]
    return out


def count(step, *args) -> dict:
    """Compile `step` (jitted, or jitted here) for the H100 on abstract `args` and count its kernels
    (`entry_kernels`), plus `compile_s`. The args must be placed by `sharding()` (see `abstract`)."""
    step = step if hasattr(step, "lower") else jax.jit(step)
    t = time.perf_counter()
    text = step.lower(*args).compile().as_text()
    out = entry_kernels(text)
    if re.search(r'custom_call_target="optim', text):
        raise AssertionError("optim's CPU kernel in a GPU program")
    return {**out, "compile_s": round(time.perf_counter() - t, 2)}


def _optax_ema(tx, decay: float):
    """optax's counterpart of `optim.EMA`: `tx`, and `optax.ema(decay, debias=False)` of the new parameters."""
    import optax

    ema = optax.ema(decay, debias=False)

    def update(g, state, p):
        u, s = tx.update(g, state[0], p)
        _, e = ema.update(optax.apply_updates(p, u), state[1])
        return u, (s, e)
    return optax.GradientTransformation(lambda p: (tx.init(p), ema.init(p)), update)


def workloads() -> dict:
    """name -> (optim rule, its optax counterpart or None)."""
    import optax
    import optim

    bf16 = jnp.bfloat16
    return {
        "Adam": (optim.Adam(1e-3), optax.adam(1e-3)),
        "clip+AdamW": (optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, weight_decay=0.1)),
                       optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))),
        "SkipNonFinite(AdamW)": (optim.SkipNonFinite(optim.AdamW(1e-3, weight_decay=0.1)),
                                 optax.apply_if_finite(optax.adamw(1e-3, weight_decay=0.1), 100)),
        "EMA(AdamW)": (optim.EMA(optim.AdamW(1e-3, weight_decay=0.1), 0.999),
                       _optax_ema(optax.adamw(1e-3, weight_decay=0.1), 0.999)),
        "Adam bf16 moments": (optim.Adam(1e-3, mu_dtype=bf16, nu_dtype=bf16), optax.adam(1e-3, mu_dtype=bf16)),
        "Muon": (optim.Muon(0.02), optax.contrib.muon(0.02)),
        "AdamW q8": (optim.AdamW(1e-3, weight_decay=0.1, mu_dtype=optim.q8, nu_dtype=optim.q8), None),
        "AdamW q4": (optim.AdamW(1e-3, weight_decay=0.1, mu_dtype=optim.q4, nu_dtype=optim.q4), None),
    }


def optim_step(state, params, grads):
    import optim
    return optim.update(state, params, grads)


def optax_step(tx):
    import optax

    def step(state, params, grads):
        updates, state = tx.update(grads, state, params)
        return state, optax.apply_updates(params, updates)
    return step


def run(sizes: dict = SIZES, skip: set = SLOW) -> list[dict]:
    import optim

    where, rows = sharding(), []
    for size, (n, shape) in sizes.items():
        params = {f"w{i:04d}": np.zeros(shape, np.float32) for i in range(n)}
        p = abstract(params, where)
        for name, (rule, tx) in workloads().items():
            if (size, name) in skip:
                continue
            for who, step, state in [("optim", optim_step, lambda: optim.setup(rule, params)),
                                     ("optax", tx and optax_step(tx), lambda: tx.init(params))]:
                if step is None:
                    continue
                jitted = jax.jit(step, donate_argnums=(0, 1))
                rows.append({"size": size, "workload": name, "who": who,
                             **count(jitted, abstract(state(), where), p, p)})
                print(f"{size} {name} {who}: {rows[-1]}", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    cols = ["fusions", "gemms", "custom_calls", "copies", "other", "kernels", "param_copies", "compile_s"]
    out = ["| leaves | workload | step | " + " | ".join(cols) + " | other ops |", "|---" * (len(cols) + 4) + "|"]
    for r in rows:
        out.append(f"| {r['size']} | {r['workload']} | {r['who']} | " + " | ".join(str(r[c]) for c in cols)
                   + f" | {', '.join(r['other_ops'])} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--all", action="store_true", help="also Muon on 1000 leaves (an hour or more)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    rows = run(skip=set() if args.all else SLOW)
    print(table(rows))
    print(f"\njax {jax.__version__}, target {SPEC.name}; {time.perf_counter() - t:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
