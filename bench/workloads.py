"""Benchmark workloads: float32 models (JAX pytrees) with a fixed gradient tree, at full or quick sizes.

A workload is built the same way in every process (fixed seed), so the step-timing process and the
per-candidate first-call processes see identical data. Ties are expressed as in user code: the same array
object at two positions of the model (`optim.setup` finds them by identity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# name -> (full spec, quick spec). Aliases are accepted on the command line.
SPECS: dict[str, tuple[dict, dict]] = {
    "1x16M": ({"kind": "leaves", "n": 1, "shape": (4096, 4096)},
              {"kind": "leaves", "n": 1, "shape": (256, 256)}),
    # The wrapped rules' workload (bench/candidates.py's WRAPPED): 100 leaves of 160k floats.
    "100x160k": ({"kind": "leaves", "n": 100, "shape": (400, 400)},
                 {"kind": "leaves", "n": 4, "shape": (20, 20)}),
    "1000x16k": ({"kind": "leaves", "n": 1000, "shape": (128, 128)},
                 {"kind": "leaves", "n": 4, "shape": (16, 16)}),
    # Issue 13's workload of many small leaves: 10000x1.6k's kind at a size whose optax first call takes ~30 s.
    "3000x1.6k": ({"kind": "leaves", "n": 3000, "shape": (40, 40)},
                  {"kind": "leaves", "n": 6, "shape": (8, 8)}),
    "10000x1.6k": ({"kind": "leaves", "n": 10000, "shape": (40, 40)},
                   {"kind": "leaves", "n": 8, "shape": (8, 8)}),
    "tied-lm": ({"kind": "lm", "vocab": 16384, "d": 512, "layers": 3, "tied": True, "twin": "untied-lm"},
                {"kind": "lm", "vocab": 64, "d": 16, "layers": 0, "tied": True, "twin": "untied-lm"}),
    "untied-lm": ({"kind": "lm", "vocab": 16384, "d": 512, "layers": 3, "tied": False},
                  {"kind": "lm", "vocab": 64, "d": 16, "layers": 0, "tied": False}),
}
ALIASES = {"big": "1x16M", "medium": "1000x16k", "many": "10000x1.6k", "tied": "tied-lm", "untied": "untied-lm"}
ORDER = list(SPECS)


def canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in SPECS:
        raise SystemExit(f"unknown workload {name!r}; choose from {ORDER} or aliases {sorted(ALIASES)}")
    return name


@dataclasses.dataclass
class Workload:
    name: str
    spec: dict
    model: Any                 # JAX pytree of float32 arrays; tied positions hold the same object
    grads: Any                 # same structure as model: one gradient per position
    unique: list               # [(param ndarray, summed gradient ndarray)] one per unique parameter
    n_positions: int           # trainable positions (tied ones counted each time)
    n_unique: int              # unique trainable parameters (elements)
    description: str
    quick: bool = False

    @property
    def unique_bytes(self) -> int:
        return 4 * self.n_unique


def _lm_shapes(vocab: int, d: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("emb", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "ln1.scale", (d,)), (p + "ln1.bias", (d,)),
                (p + "attn.wq", (d, d)), (p + "attn.wk", (d, d)), (p + "attn.wv", (d, d)), (p + "attn.wo", (d, d)),
                (p + "ln2.scale", (d,)), (p + "ln2.bias", (d,)),
                (p + "mlp.w1", (d, 4 * d)), (p + "mlp.b1", (4 * d,)),
                (p + "mlp.w2", (4 * d, d)), (p + "mlp.b2", (d,))]
    out += [("ln_f.scale", (d,)), ("ln_f.bias", (d,))]
    return out


def _nest(flat: dict[str, Any]) -> dict:
    """{'layers.0.w': x} -> {'layers': [{'w': x}]} (numeric keys become list indices)."""
    root: dict = {}
    for path, v in flat.items():
        parts = path.split(".")
        node = root
        for a, b in zip(parts[:-1], parts[1:]):
            nxt = [] if b.isdigit() else {}
            if isinstance(node, list):
                a = int(a)
                while len(node) <= a:
                    node.append(nxt)
                node = node[a]
            else:
                node = node.setdefault(a, nxt)
        node[parts[-1]] = v
    return root


def build(name: str, quick: bool = False, seed: int = 0) -> Workload:
    import jax.numpy as jnp

    name = canonical(name)
    spec = SPECS[name][1 if quick else 0]
    rng = np.random.default_rng(seed)

    def arr(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

    if spec["kind"] == "leaves":
        n, shape = spec["n"], spec["shape"]
        xs = [arr(shape, 0.02) for _ in range(n)]
        gs = [arr(shape, 1e-3) for _ in range(n)]
        if n == 1:
            model, grads = {"w": jnp.asarray(xs[0])}, {"w": jnp.asarray(gs[0])}
        else:
            model = {"layers": [{"w": jnp.asarray(x)} for x in xs]}
            grads = {"layers": [{"w": jnp.asarray(g)} for g in gs]}
        unique = list(zip(xs, gs))
        size = int(np.prod(shape))
        desc = f"{n} {'leaves' if n > 1 else 'leaf'} of {shape} float32 ({n * size / 1e6:.2f}M parameters)"
        return Workload(name, spec, model, grads, unique, n, n * size, desc, quick)

    vocab, d, layers, tied = spec["vocab"], spec["d"], spec["layers"], spec["tied"]
    shapes = _lm_shapes(vocab, d, layers)
    xs = {p: arr(s, 0.02) for p, s in shapes}
    gs = {p: arr(s, 1e-3) for p, s in shapes}
    jx = {p: jnp.asarray(v) for p, v in xs.items()}
    jg = {p: jnp.asarray(v) for p, v in gs.items()}
    if tied:
        jx["head.w"] = jx["emb"]                      # the same object: one parameter for optim
        gh = arr((vocab, d), 1e-3)
        jg["head.w"] = jnp.asarray(gh)
        gs = dict(gs, emb=gs["emb"] + gh)             # torch sees one tensor with the summed gradient
    model, grads = _nest(jx), _nest(jg)
    unique = [(xs[p], gs[p]) for p, _ in shapes]
    n_unique = sum(int(np.prod(s)) for _, s in shapes)
    n_pos = len(shapes) + (1 if tied else 0)
    desc = (f"transformer-like, vocab {vocab}, d {d}, {layers} layers, {len(shapes)} unique leaves, "
            f"{n_unique / 1e6:.2f}M unique parameters"
            + (f"; head.w tied to emb ({(n_unique + vocab * d) / 1e6:.2f}M parameters by position)" if tied
               else "; no head (same unique parameters as tied-lm)"))
    return Workload(name, spec, model, grads, unique, n_pos, n_unique, desc, quick)


_CACHE: dict = {}


def build_cached(name: str, quick: bool = False) -> Workload:
    key = (canonical(name), quick)
    if key not in _CACHE:
        _CACHE[key] = build(name, quick)
    return _CACHE[key]
