"""`python -m bench.kernels [--trees ...] [--workloads ...] [--json OUT]`: the GPU kernels one jitted update step
launches and the bytes they move, without a GPU.

Method (issue 38): XLA's deviceless compile for an H100. `jax.experimental.topologies.get_topology_desc` builds
a CUDA device from a target description (`bench/gpu_specs/h100_sxm.txtpb`, XLA's `h100_sxm` GpuTargetConfigProto)
instead of a real GPU; the step is jitted, lowered on abstract arguments (`jax.ShapeDtypeStruct`s with a
`SingleDeviceSharding` on that device) and compiled by XLA:GPU's full pipeline (fusion, scheduling, and ptxas
from `nvidia-cuda-nvcc-cu12`).

Kernels (`module_kernels`): in the compiled module's ENTRY computation each `fusion` is one kernel, each
`custom-call` one library call (cuBLAS, cuDNN), each `copy` one copy kernel; anything else that is not free
(`parameter`, `constant`, `tuple`, `get-tuple-element`, `bitcast`) is listed as `other`. A `while` loop's body
counts its known trip count times (its condition once more), a `conditional` the branch that moves the most bytes,
a `call` its computation (no step measured here has any of the three). In this deviceless compile each matmul is a
Triton gemm fusion (`kind=kCustom`, not a cuBLAS custom-call), counted in `fusions` and apart as `gemms`. A `copy`
with as many elements as one of ENTRY's array parameters (parameter, gradient or state array) is a whole array
copied per step (`param_copies`; a small state array's copy counts too: on one 4096x4096 leaf Adam's one copy is
of its `(1, 2)` bias-correction pack); `largest_copy` is the number of elements of the largest copy.

Bytes: each kernel's operands plus its outputs, at the sizes of their compiled shapes (caches are not modelled),
times its executions. One refinement: of a fusion's operand only the elements that its fused computation demands
count (`_demand`). Demand goes backwards from the fusion's outputs through elementwise ops, broadcasts, bitcasts
that add or drop unit dimensions, `slice`, `dynamic-slice` (its size) and `concatenate` (to each operand its part);
any other op demands the whole of its operands. So a multi-output kernel that writes members 0-44 of a stack
counts members 0-44 of each stacked operand, and of the gradients it reads through their concatenation those
members' own; without this, Adam's grouped step on 100 x 400x400 would be charged 658 MB instead of 576.

Floor (`floor_bytes`): the least a step can move: read the gradients and the (distinct) parameters once, write
every output parameter, read and write the state once, plus `PASSES` more reads of the gradients for a wrapper
whose result every parameter waits for (ClipGlobalNorm's global norm, SkipNonFinite's check). Per parameter:
float32 Adam(W) 28 bytes, bfloat16 m and v 20, q8 16.06 and q4 14.13 (codes and a float32 scale a block);
on the tied tree the head's gradient and its output add 8 bytes on the embedding's elements.

Trees (`tree`): the same 16M float32 parameters as 1 x 4096x4096, 100 x 400x400 and 1000 x 128x128 leaves, and
`gpt2`: GPT-2 small's layout with biases (vocabulary 32768 x 768 embedding, 1024 x 768 positions, 12 blocks of
width 768 with qkv 768x2304, proj 768x768, mlp 768x3072 and 3072x768, LayerNorm gains and biases; 148 leaves,
111.0M parameters); `gpt2-tied` adds a `head` position that *is* the embedding's array (one tie). optax runs on
`gpt2` only: for it the tied tree is the untied one (a model's autodiff has already summed the two uses).

The steps: optim's `optim.update(state, params, grads)` and optax's `tx.update` + `optax.apply_updates`, both
`jax.jit(..., donate_argnums=(0, 1))` on `(state, params, grads)`; the state is set up on CPU arrays and made
abstract. optim's fused CPU kernel cannot appear: which code runs is chosen when the program is lowered
(optim._engine.kernel_choice), and a program lowered for CUDA gets XLA's code.

Needs jax, jaxlib, jax-cuda12-plugin and jax-cuda12-pjrt of one version, nvidia-cuda-nvcc-cu12, optax; no GPU.
`make gpu-kernels` installs them in `.venv-gpu` and runs this (run as a script it sets JAX_PLATFORMS=cpu,
OPTIM_GROUP=all and OPTIM_FUSED=0 where unset; imported, it leaves the environment alone). A CI test can import
`count`, `tree` and `workloads` (tests/test_gpu_kernels.py); the parser needs no CUDA plugin. Muon on 1000 leaves
is left out unless `--all`: each of its programs has ~15 matmuls per leaf, and XLA:GPU's multi-output fusion pass
takes 20 minutes and more on them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":
    # The CUDA target is deviceless: no GPU backend to start. `setup` runs in this CPU-only process but builds the
    # state a GPU process would: XLA's path grouping large parameters (optim._engine.group, on where there is a
    # GPU) and not the fused CPU kernel's stacking of its rules. Only when run as a script: an importer (bench.gpu
    # on a GPU, the test suite) keeps its own environment and passes it on to its subprocesses.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("OPTIM_GROUP", "all")
    os.environ.setdefault("OPTIM_FUSED", "0")

import jax                # noqa: E402
import jax.numpy as jnp   # noqa: E402
import numpy as np        # noqa: E402

SPEC = Path(__file__).with_name("gpu_specs") / "h100_sxm.txtpb"
SIZES = {"1x4096x4096": (1, (4096, 4096)), "100x400x400": (100, (400, 400)), "1000x128x128": (1000, (128, 128))}
TREES = (*SIZES, "gpt2", "gpt2-tied")
SLOW = {("1000x128x128", "Muon")}      # left out unless --all (see above)
# Reads of the gradients before the step (see the floor); a clip and a skip read them in one pass.
PASSES = {"clip+AdamW": 1, "SkipNonFinite(AdamW)": 1, "SkipNonFinite(EMA(clip+AdamW))": 1}
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "opt-barrier"}
ELEMENTWISE = {
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "convert", "copy", "cosine", "divide",
    "erf", "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one", "logistic",
    "maximum", "minimum", "multiply", "negate", "not", "or", "popcnt", "power", "real", "reduce-precision",
    "remainder", "round-nearest-afz", "round-nearest-even", "rsqrt", "select", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor",
    "bitcast-convert"}
_INSTR = re.compile(r"^\s*(ROOT )?%([^\s=]+) = (.*)$")


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


# ------------------------------------------------------------------------------------- the compiled module's text
@dataclass
class Instr:
    """One instruction: `%name = shape op(args), attrs`."""
    name: str
    shape: str        # `f32[64,400,400]{2,1,0}`, or a tuple `(f32[4]{0}, /*index=1*/s32[])`
    op: str
    args: str         # the text between the op's parentheses: operand names, or a parameter's number
    attrs: str
    root: bool

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([^\s,()]+)", self.args)


@dataclass
class Kernel:
    name: str
    op: str           # fusion, custom-call, copy, or another op's name
    shape: str        # its output
    read: float       # bytes (demanded: see the module docstring)
    written: float
    times: int        # executions a step
    gemm: bool = False


def _split(rhs: str) -> tuple[str, str]:
    """`<shape> rest` -> (shape, rest); a tuple shape is skipped by its balanced parentheses."""
    if not rhs.startswith("("):
        shape, _, rest = rhs.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(rhs):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            break
    return rhs[:i + 1], rhs[i + 1:].lstrip()


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array of a shape (each element of a tuple)."""
    found = re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape)
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in found]


def _dims(shape: str) -> tuple[int, ...] | None:
    """The dimensions of an array shape; None for a tuple."""
    a = _arrays(shape)
    return a[0][1] if len(a) == 1 and not shape.startswith("(") else None


def _itemsize(dtype: str) -> float:
    """Bytes of an element: f32 4, bf16 2, u8 1, s4 0.5, f8e4m3fn 1, pred 1, token 0."""
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    return int(bits.group()) / 8 if bits else 0


def nbytes(shape: str) -> float:
    return sum(math.prod(dims) * _itemsize(t) for t, dims in _arrays(shape))


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """A module's text -> (computation name -> its instructions in order, the ENTRY computation's name)."""
    comps, entry, body = {}, "", None
    for line in text.splitlines():
        if body is None:
            if line.endswith("{") and not line.startswith((" ", "HloModule")):
                m = re.match(r"(ENTRY )?%?([^\s(]+)", line)
                body = comps.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.startswith("}"):
            body = None
        elif m := _INSTR.match(line):
            shape, rest = _split(m.group(3))
            op, _, rest = rest.partition("(")
            depth, end = 1, len(rest)
            for end, ch in enumerate(rest):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    break
            body.append(Instr(m.group(2), shape, op, rest[:end], rest[end + 1:], bool(m.group(1))))
    if not entry:
        raise ValueError("no ENTRY computation in the module's text")
    return comps, entry


def _ref(attrs: str, key: str) -> list[str]:
    """The computations an attribute names: `calls=%f`, `branch_computations={%a, %b}`."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[^\s,]+)", attrs)
    return re.findall(r"%([^\s,{}]+)", m.group(1)) if m else []


# ------------------------------------------------------------------------------------------- demanded elements
Box = tuple[tuple[int, int], ...]     # [lo, hi) per dimension


def _demand(body: list[Instr]) -> dict[str, set]:
    """For each value of a fused computation, the boxes of its elements that the fusion's outputs need (a value of
    tuple shape: {"all"}). Propagated backwards from the root, see the module docstring."""
    by = {i.name: i for i in body}
    dem: dict[str, set] = {}

    def need(name: str, boxes) -> None:
        dem.setdefault(name, set()).update(boxes)

    def need_all(name: str) -> None:
        d = _dims(by[name].shape)
        need(name, ["all"] if d is None else [tuple((0, n) for n in d)])

    root = next((i for i in body if i.root), body[-1])
    need_all(root.name)
    for ins in reversed(body):
        boxes, dims = dem.get(ins.name), _dims(ins.shape)
        if not boxes or ins.op == "parameter":
            continue
        ops = [o for o in ins.operands if o in by]
        src = [_dims(by[o].shape) for o in ops]
        if dims is None or "all" in boxes:
            for o in ops:
                need_all(o)
        elif ins.op in ELEMENTWISE:
            for o, d in zip(ops, src):
                if d == dims:
                    need(o, boxes)
                else:
                    need_all(o)
        elif ins.op == "broadcast":               # operand dimension k is output dimension dimensions[k]
            m = re.search(r"dimensions=\{([\d,]*)\}", ins.attrs)
            ks = [int(k) for k in m.group(1).split(",") if k] if m else []
            need(ops[0], {tuple(b[k] for k in ks) for b in boxes})
        elif ins.op == "bitcast" and src[0] and [n for n in src[0] if n != 1] == [n for n in dims if n != 1]:
            def drop_add(b: Box) -> Box:          # drop the unit dimensions of the output, add the operand's
                kept = iter(iv for iv, n in zip(b, dims) if n != 1)
                return tuple(next(kept) if n != 1 else (0, 1) for n in src[0])
            need(ops[0], {drop_add(b) for b in boxes})
        elif ins.op == "slice":
            spec = re.search(r"slice=\{([^}]*)\}", ins.attrs).group(1)
            rng = [tuple(int(x) for x in r.split(":")) for r in re.findall(r"\[([\d:]+)\]", spec)]
            if all(len(r) == 2 or r[2] == 1 for r in rng):
                need(ops[0], {tuple((r[0] + lo, r[0] + hi) for r, (lo, hi) in zip(rng, b)) for b in boxes})
            else:
                need_all(ops[0])
        elif ins.op == "dynamic-slice":           # where is not known here: its size, at the origin
            need(ops[0], [tuple((0, n) for n in dims)])
            for o in ops[1:]:
                need_all(o)
        elif ins.op == "concatenate":
            k = int(re.search(r"dimensions=\{(\d+)\}", ins.attrs).group(1))
            start = 0
            for o, d in zip(ops, src):
                part = {b[:k] + ((lo - start, hi - start),) + b[k + 1:] for b in boxes
                        for lo, hi in [(max(b[k][0], start), min(b[k][1], start + d[k]))] if lo < hi}
                need(o, part)
                start += d[k]
        else:
            for o in ops:
                need_all(o)
    return dem


def _read(param: Instr, dem: dict, full: float) -> float:
    """Bytes of a fusion's operand that its computation reads: the demanded boxes' elements, at most `full`."""
    boxes = dem.get(param.name, set())
    if "all" in boxes:
        return full
    size = _itemsize(_arrays(param.shape)[0][0]) if boxes else 0
    return min(full, size * sum(math.prod(hi - lo for lo, hi in b) for b in boxes))


# ----------------------------------------------------------------------------------------------------- kernels
def module_kernels(text: str) -> list[Kernel]:
    """The kernels of a compiled GPU module's text, each with the bytes it reads and writes (module docstring)."""
    comps, entry = parse(text)

    def kernel(by: dict, ins: Instr, times: int) -> Kernel:
        sizes = [nbytes(by[o].shape) for o in ins.operands]
        fused = comps.get(next(iter(_ref(ins.attrs, "calls")), "")) if ins.op == "fusion" else None
        if fused:
            dem = _demand(fused)
            params = {int(i.args): i for i in fused if i.op == "parameter"}
            sizes = [_read(params[k], dem, full) for k, full in enumerate(sizes)]
        gemm = ins.op == "fusion" and "kind=kCustom" in ins.attrs and "gemm" in ins.attrs
        return Kernel(ins.name, ins.op, ins.shape, sum(sizes), nbytes(ins.shape), times, gemm)

    def walk(name: str, times: int) -> list[Kernel]:
        by = {i.name: i for i in comps[name]}
        out = []
        for ins in comps[name]:
            if ins.op in FREE:
                continue
            if ins.op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                n = int(trips.group(1)) if trips else 1
                out += walk(_ref(ins.attrs, "condition")[0], times * (n + 1)) + walk(_ref(ins.attrs, "body")[0],
                                                                                     times * n)
            elif ins.op == "call":
                out += walk(_ref(ins.attrs, "to_apply")[0], times)
            elif ins.op == "conditional":
                names = _ref(ins.attrs, "branch_computations") or (_ref(ins.attrs, "true_computation")
                                                                   + _ref(ins.attrs, "false_computation"))
                out += max((walk(b, times) for b in names), key=lambda ks: sum(k.read + k.written for k in ks))
            else:
                out.append(kernel(by, ins, times))
        return out

    return walk(entry, 1)


def entry_kernels(hlo_text: str) -> dict:
    """Kernel counts and bytes (read + written, each kernel times its executions) of a compiled GPU module's text
    (see the module docstring)."""
    ks = module_kernels(hlo_text)
    comps, entry = parse(hlo_text)
    params = {math.prod(d) for i in comps[entry] if i.op == "parameter" and (d := _dims(i.shape))}

    def n(pred) -> int:
        return sum(k.times for k in ks if pred(k))
    other = sorted({k.op for k in ks if k.op not in ("fusion", "custom-call", "copy")})
    out = {"fusions": n(lambda k: k.op == "fusion"), "gemms": n(lambda k: k.gemm),
           "custom_calls": n(lambda k: k.op == "custom-call"), "copies": n(lambda k: k.op == "copy"),
           "param_copies": n(lambda k: k.op == "copy" and (d := _dims(k.shape)) and math.prod(d) in params),
           "largest_copy": max((math.prod(d) for k in ks if k.op == "copy" and (d := _dims(k.shape))), default=0),
           "other": n(lambda k: k.op not in ("fusion", "custom-call", "copy")), "other_ops": other,
           "kernels": n(lambda k: True),
           "read": round(sum(k.read * k.times for k in ks)), "written": round(sum(k.written * k.times for k in ks))}
    out["bytes"] = out["read"] + out["written"]
    return out


def count(step, *args) -> dict:
    """Compile `step` (jitted, or jitted here) for the H100 on abstract `args`, count its kernels and bytes
    (`entry_kernels`), plus `compile_s` and `peak_bytes` (arguments and temporaries, XLA's `memory_analysis`). The
    args must be placed by `sharding()` (see `abstract`)."""
    step = step if hasattr(step, "lower") else jax.jit(step)
    t = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t
    text = compiled.as_text()
    out = entry_kernels(text)
    if re.search(r'custom_call_target="optim', text):
        raise AssertionError("optim's CPU kernel in a GPU program")
    memory = compiled.memory_analysis()
    return {**out, "compile_s": round(compile_s, 2),
            "peak_bytes": memory.argument_size_in_bytes + memory.temp_size_in_bytes}


def _nbytes(tree, distinct: bool = False) -> int:
    """Bytes of a tree's arrays; `distinct`: an array held at two positions (a tie) once."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    if distinct:
        leaves = list({id(x): x for x in leaves}.values())
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in leaves)


def floor_bytes(state, params, grads, passes: int = 0) -> int:
    """The least a step can move (module docstring): gradients read 1 + `passes` times, the distinct parameters
    read once, every output parameter written, the state read and written."""
    return (1 + passes) * _nbytes(grads) + _nbytes(params, True) + _nbytes(params) + 2 * _nbytes(state)


def tree(name: str) -> dict:
    """The parameters of tree `name` (`TREES`, module docstring): float32 numpy zeros (not allocated until
    written)."""
    if name in SIZES:
        n, shape = SIZES[name]
        return {f"w{i:04d}": np.zeros(shape, np.float32) for i in range(n)}
    if name not in ("gpt2", "gpt2-tied"):
        raise ValueError(f"unknown tree {name!r}: one of {', '.join(TREES)}")
    vocab, positions, width, blocks = 32768, 1024, 768, 12

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    def linear(n_in, n_out):
        return {"w": zeros(n_in, n_out), "b": zeros(n_out)}

    def norm():
        return {"g": zeros(width), "b": zeros(width)}

    params = {"wte": zeros(vocab, width), "wpe": zeros(positions, width), "ln_f": norm(),
              "h": [{"ln_1": norm(), "attn": {"c_attn": linear(width, 3 * width), "c_proj": linear(width, width)},
                     "ln_2": norm(), "mlp": {"c_fc": linear(width, 4 * width), "c_proj": linear(4 * width, width)}}
                    for _ in range(blocks)]}
    if name == "gpt2-tied":
        params["head"] = params["wte"]
    return params


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

    bf16, b2 = jnp.bfloat16, 0.999

    def muon(path, x):
        # optax.contrib.muon sends non-2-D parameters to adamw(nesterov=True): optim's NAdam with lr and eps
        # scaled by sqrt(b2) (bench/rules.py); on the leaf trees every parameter is 2-D
        return optim.Muon(0.02) if x.ndim == 2 else optim.NAdam(0.02 * b2 ** 0.5, eps=1e-8 * b2 ** 0.5)

    return {
        "Adam": (optim.Adam(1e-3), optax.adam(1e-3)),
        "AdamW": (optim.AdamW(1e-3, weight_decay=0.1), optax.adamw(1e-3, weight_decay=0.1)),
        "clip+AdamW": (optim.chain(optim.ClipGlobalNorm(1.0), optim.AdamW(1e-3, weight_decay=0.1)),
                       optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))),
        "SkipNonFinite(AdamW)": (optim.SkipNonFinite(optim.AdamW(1e-3, weight_decay=0.1)),
                                 optax.apply_if_finite(optax.adamw(1e-3, weight_decay=0.1), 100)),
        "EMA(AdamW)": (optim.EMA(optim.AdamW(1e-3, weight_decay=0.1), 0.999),
                       _optax_ema(optax.adamw(1e-3, weight_decay=0.1), 0.999)),
        # The demo's stack (docs/benchmarks.md, "A whole training step"), its average of a fixed decay.
        "SkipNonFinite(EMA(clip+AdamW))": (
            optim.SkipNonFinite(optim.EMA(optim.chain(optim.ClipGlobalNorm(1.0),
                                                      optim.AdamW(1e-3, weight_decay=0.1)), 0.999)),
            optax.apply_if_finite(_optax_ema(optax.chain(optax.clip_by_global_norm(1.0),
                                                         optax.adamw(1e-3, weight_decay=0.1)), 0.999), 100)),
        "Adam bf16 moments": (optim.Adam(1e-3, mu_dtype=bf16, nu_dtype=bf16), optax.adam(1e-3, mu_dtype=bf16)),
        "Muon": (muon, optax.contrib.muon(0.02)),
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


def measure(tree_name: str, workload: str, who: str, rule, tx=None, where=None) -> dict:
    """Compile one donated step (`who`: "optim" or "optax") on tree `tree_name`: `count`'s row plus the tree's
    distinct parameters (`params`), `bytes_per_param` and the `floor` a parameter (`floor_bytes`)."""
    import optim

    params = tree(tree_name)
    state = optim.setup(rule, params) if who == "optim" else tx.init(params)
    where = where or sharding()
    n = sum(x.size for x in {id(x): x for x in jax.tree.leaves(params)}.values())
    floor = floor_bytes(state, params, params, PASSES.get(workload, 0))
    step = optim_step if who == "optim" else optax_step(tx)
    got = count(jax.jit(step, donate_argnums=(0, 1)), *(abstract(a, where) for a in (state, params, params)))
    return {"tree": tree_name, "params": n, "workload": workload, "who": who, **got,
            "bytes_per_param": round(got["bytes"] / n, 2), "floor": round(floor / n, 2)}


def run(trees=TREES, names=None, skip: set = SLOW) -> list[dict]:
    """`measure` each workload (`names`: all) on each tree, optim then optax (optax not on gpt2-tied)."""
    where, rows = sharding(), []
    # XLA:GPU's first compile in a process also starts the compiler (~0.6-1 s on GPT-2's AdamW), which would be
    # charged to the first row: compile a small program first.
    jax.jit(lambda a: a * 2 + 1).lower(abstract(np.zeros((1024,), np.float32), where)).compile()
    for tree_name in trees:
        for name, (rule, tx) in workloads().items():
            if (names and name not in names) or (tree_name, name) in skip:
                continue
            for who in ["optim"] + (["optax"] if tx is not None and tree_name != "gpt2-tied" else []):
                rows.append(measure(tree_name, name, who, rule, tx, where))
                print(f"{tree_name} {name} {who}: {rows[-1]}", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    cols = ["kernels", "fusions", "gemms", "custom_calls", "copies", "other", "param_copies"]
    out = ["| tree | workload | step | " + " | ".join(cols) + " | MB | B/param | floor | compile s | other ops |",
           "|---|---|---" + "|---:" * (len(cols) + 4) + "|---|"]
    for r in rows:
        out.append(f"| {r['tree']} | {r['workload']} | {r['who']} | " + " | ".join(str(r[c]) for c in cols)
                   + f" | {r['bytes'] / 1e6:.0f} | {r['bytes_per_param']:.1f} | {r['floor']:.1f} | {r['compile_s']}"
                   + f" | {', '.join(r['other_ops'])} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=",".join(TREES), help=f"comma-separated, of {', '.join(TREES)} (default: all)")
    ap.add_argument("--workloads", default="", help="comma-separated workload names (default: all)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--all", action="store_true", help="also Muon on 1000 leaves (an hour or more)")
    args = ap.parse_args(argv)
    trees = args.trees.split(",")
    names = [w for w in args.workloads.split(",") if w]
    for bad, known in [(set(trees) - set(TREES), TREES), (set(names) - set(workloads()), list(workloads()))]:
        if bad:
            ap.error(f"unknown {', '.join(sorted(bad))}: one of {', '.join(known)}")
    t = time.perf_counter()
    rows = run(trees, names, skip=set() if args.all else SLOW)
    print(table(rows))
    print(f"\njax {jax.__version__}, target {SPEC.name}; {time.perf_counter() - t:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
