"""The candidates: one Adam step (float32) over a workload, each holding its own copy of parameters and state.

Every candidate exposes `step()` (one optimiser step; may return before the device finishes), `block()` (wait
for the last step) and `state_bytes()` (optimiser-state bytes, each buffer counted once). Donated candidates
consume their previous buffers, so each owns private copies of the parameters; the gradients are shared.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable

import numpy as np

LR = 1e-3
PROBE_BYTES = 12      # a += b: read a, read b, write a (float32)
ADAM_BYTES = 28       # Adam: read p, g, m, v; write p, m, v (float32)

JAX_CANDIDATES = ["optim eager", "optim eager donate", "optim jit", "optim jit xla", "optax", "optax.flatten", "probe"]
UNTIED = " @untied"   # suffix: the same candidate on the untied twin of a tied workload (same unique parameters)
TORCH_CANDIDATES = ["torch foreach", "torch fused"]
ALL = JAX_CANDIDATES + TORCH_CANDIDATES
# Other rules, wrapped rules and their optax counterparts (jitted, donated): only when named, e.g.
# `python -m bench --only medium --no-torch --candidates "optim jit adamw,optim jit skipnonfinite(adamw),optax"`.
WRAPPED = ["optim jit adamw", "optim jit skipnonfinite(adamw)", "optim jit ema(adamw)", "optim jit adam bf16",
           "optim jit nadam", "optim jit clip+adamw", "optim jit skipnonfinite(clip+adamw)", "optax adamw",
           "optax apply_if_finite(adamw)", "optax adamw+ema", "optax clip+adamw", "optax apply_if_finite(clip+adamw)",
           # The rules the kernel runs since the third round, on the kernel and on XLA's path, and optax's.
           *[f"{who} {rule}" for rule in ("adabelief", "amsgrad", "radam", "adopt", "rmsprop", "rmsprop centred",
                                          "ademamix") for who in ("optim jit", "optim jit xla", "optax")]]
REFERENCE = "optax"


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def available(names: list[str] | None = None, torch: bool = True) -> list[str]:
    names = list(ALL if names is None else names)
    if not (torch and torch_available()):
        names = [n for n in names if n not in TORCH_CANDIDATES]
    return names


def _copy_tree(tree):
    """Copy every distinct buffer once, keeping positions that shared an object sharing the copy (ties)."""
    import jax

    memo: dict[int, object] = {}

    def cp(x):
        if not hasattr(x, "shape"):
            return x
        if id(x) not in memo:
            memo[id(x)] = _copy(x)
        return memo[id(x)]

    return jax.tree.map(cp, tree)


def _copy(x):
    """A fresh device buffer with x's contents (via host: no per-shape compilation, unlike jnp.copy)."""
    import jax

    return jax.device_put(np.array(x, copy=True))


def unalias(tree):
    """Copy any array whose buffer already appeared earlier in `tree`: JAX refuses to donate one buffer twice.

    Needed for a tied model passed to a donating jit (a user-side necessity: optim's tie map keeps the
    positions tied); also guards against a state whose leaves alias each other or the rule's hyperparameters
    (optim's Adam state did at 6bfda98: its bias-correction scalars were the rule's beta arrays).
    """
    import jax

    seen: set = set()

    def fix(x):
        if not isinstance(x, jax.Array):
            return x
        key = x.unsafe_buffer_pointer() if x.size else id(x)
        if key in seen:
            x = _copy(x)
            key = x.unsafe_buffer_pointer() if x.size else id(x)
        seen.add(key)
        return x

    return jax.tree.map(fix, tree)


def tree_bytes(tree) -> int:
    import jax

    seen, total = set(), 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "nbytes") and id(x) not in seen:
            seen.add(id(x))
            total += int(x.nbytes)
    return total


class Candidate:
    name: str
    step: Callable[[], None]

    def block(self) -> None:
        pass

    def state_bytes(self) -> int | None:
        return None


class OptimEager(Candidate):
    def __init__(self, wl, donate: bool = False):
        import optim

        self.name = "optim eager donate" if donate else "optim eager"
        self._optim, self._donate, self._grads = optim, donate, wl.grads
        self.model = _copy_tree(wl.model)
        self.state = optim.setup(optim.Adam(LR), self.model)
        if donate:
            # Workaround for the beta-aliasing bug: without it the first donated call fails.
            self.state = unalias(self.state)

    def step(self):
        self.state, self.model = self._optim.update(self.state, self.model, self._grads, donate=self._donate)

    def block(self):
        import jax
        jax.block_until_ready((self.state, self.model))

    def state_bytes(self):
        return tree_bytes(self.state.stacks)


class OptimJit(Candidate):
    name = "optim jit"

    def __init__(self, wl):
        import jax
        import optim

        model = _copy_tree(wl.model)
        state = optim.setup(optim.Adam(LR), model)
        self.state, self.model = unalias((state, model))
        self._grads = wl.grads
        self._fn = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))

    def step(self):
        self.state, self.model = self._fn(self.state, self.model, self._grads)

    def block(self):
        import jax
        jax.block_until_ready((self.state, self.model))

    def state_bytes(self):
        return tree_bytes(self.state.stacks)


class OptimJitXla(OptimJit):
    """`optim jit` with optim's fused CPU kernel off (`optim._engine.fused.ENABLED`, as `OPTIM_FUSED=0`): the rules' JAX
    code, as XLA compiles it, and the stacks `setup` makes for it (large parameters alone)."""

    name = "optim jit xla"

    def __init__(self, wl):
        with _no_kernel():
            super().__init__(wl)

    def step(self):
        with _no_kernel():        # read when update traces (the first step); the flip costs ~100 ns per step
            super().step()


class _no_kernel:
    def __enter__(self):
        from optim._engine import fused as _fused

        self._fused, self._was = _fused, _fused.ENABLED
        _fused.ENABLED = False

    def __exit__(self, *exc):
        self._fused.ENABLED = self._was


class Optax(Candidate):
    def __init__(self, wl, flat: bool = False):
        import jax
        import optax

        self.name = "optax.flatten" if flat else "optax"
        tx = optax.adam(LR)
        if flat:
            tx = optax.flatten(tx)
        self.params = unalias(_copy_tree(wl.model))   # optax treats tied positions as separate parameters
        self.opt_state = tx.init(self.params)
        self._grads = wl.grads

        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._fn = jax.jit(step, donate_argnums=(0, 1))

    def step(self):
        self.params, self.opt_state = self._fn(self.params, self.opt_state, self._grads)

    def block(self):
        import jax
        jax.block_until_ready((self.params, self.opt_state))

    def state_bytes(self):
        return tree_bytes(self.opt_state)


def _optim_rule(name: str):
    import jax.numpy as jnp
    import optim

    adamw = optim.AdamW(LR, weight_decay=1e-4)
    clipped = optim.chain(optim.ClipGlobalNorm(1.0), adamw)
    return {"adamw": adamw, "skipnonfinite(adamw)": optim.SkipNonFinite(adamw), "ema(adamw)": optim.EMA(adamw),
            "adam bf16": optim.Adam(LR, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
            "nadam": optim.NAdam(LR), "clip+adamw": clipped,
            "skipnonfinite(clip+adamw)": optim.SkipNonFinite(clipped), "adabelief": optim.AdaBelief(LR),
            "amsgrad": optim.AMSGrad(LR), "radam": optim.RAdam(LR), "adopt": optim.ADOPT(LR),
            "rmsprop": optim.RMSProp(LR), "rmsprop centred": optim.RMSProp(LR, centred=True),
            "ademamix": optim.AdEMAMix(LR)}[name]


class OptimJitRule(OptimJit):
    """`optim jit` with another rule (`WRAPPED`); `optim jit xla <rule>`: with the kernel off."""

    def __init__(self, wl, name: str):
        import jax
        import optim

        self.name = name
        self._xla = name.startswith("optim jit xla ")
        model = _copy_tree(wl.model)
        with _no_kernel() if self._xla else contextlib.nullcontext():
            state = optim.setup(_optim_rule(name[len("optim jit xla " if self._xla else "optim jit "):]), model)
        self.state, self.model = unalias((state, model))
        self._grads = wl.grads
        self._fn = jax.jit(lambda s, m, g: optim.update(s, m, g), donate_argnums=(0, 1))

    def step(self):
        with _no_kernel() if self._xla else contextlib.nullcontext():
            super().step()


class OptaxRule(Optax):
    """optax's counterparts of `WRAPPED`: adamw (weight decay 1e-4), `apply_if_finite(adamw)`, adamw with an
    EMA of the parameters (decay 0.999, no debiasing) in the same jitted step, `chain(clip_by_global_norm(1.0),
    adamw)` alone and in `apply_if_finite`, and the rules optim's equal (their docstrings say so)."""

    def __init__(self, wl, name: str):
        import jax
        import optax

        self.name = name
        tx = {"optax adabelief": lambda: optax.adabelief(LR, eps=1e-16, eps_root=1e-16),
              "optax amsgrad": lambda: optax.amsgrad(LR, bias_correction_mu=False, bias_correction_nu=False),
              "optax radam": lambda: optax.radam(LR, threshold=4.0), "optax adopt": lambda: optax.contrib.adopt(LR),
              "optax rmsprop": lambda: optax.rmsprop(LR, decay=0.9, eps=1e-8, eps_in_sqrt=False),
              "optax rmsprop centred": lambda: optax.rmsprop(LR, decay=0.9, eps=1e-8, eps_in_sqrt=False, centered=True),
              "optax ademamix": lambda: optax.contrib.ademamix(LR),
              }.get(name, lambda: optax.adamw(LR, weight_decay=1e-4))()
        if "clip+" in name:
            tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
        if name.startswith("optax apply_if_finite("):
            tx = optax.apply_if_finite(tx, max_consecutive_errors=10**9)
        ema = optax.ema(0.999, debias=False) if name == "optax adamw+ema" else None
        self.params = unalias(_copy_tree(wl.model))
        self.opt_state = (tx.init(self.params), ema.init(self.params) if ema else None)
        self._grads = wl.grads

        def step(params, opt_state, grads):
            s, e = opt_state
            updates, s = tx.update(grads, s, params)
            params = optax.apply_updates(params, updates)
            if ema is not None:
                _, e = ema.update(params, e)
            return params, (s, e)

        self._fn = jax.jit(step, donate_argnums=(0, 1))


class OptaxEager(Candidate):
    """optax without jit (only for the per-call overhead table)."""

    name = "optax eager"

    def __init__(self, wl):
        import optax

        self._optax = optax
        self._tx = optax.adam(LR)
        self.params = _copy_tree(wl.model)
        self.opt_state = self._tx.init(self.params)
        self._grads = wl.grads

    def step(self):
        updates, self.opt_state = self._tx.update(self._grads, self.opt_state, self.params)
        self.params = self._optax.apply_updates(self.params, updates)

    def block(self):
        import jax
        jax.block_until_ready((self.params, self.opt_state))

    def state_bytes(self):
        return tree_bytes(self.opt_state)


class Probe(Candidate):
    """In-place bandwidth probe over the same number of (unique) parameters: jitted, donated `a += b`."""

    name = "probe"

    def __init__(self, wl):
        import jax

        n = wl.n_unique
        self.a = jax.device_put(np.zeros((n,), np.float32))
        self.b = jax.device_put(np.full((n,), 1e-3, np.float32))
        self._fn = jax.jit(lambda a, b: a + b, donate_argnums=0)

    def step(self):
        self.a = self._fn(self.a, self.b)

    def block(self):
        self.a.block_until_ready()


class Torch(Candidate):
    def __init__(self, wl, fused: bool):
        import os

        import torch

        if os.environ.get("BENCH_TORCH_THREADS"):
            torch.set_num_threads(int(os.environ["BENCH_TORCH_THREADS"]))
        self.name = "torch fused" if fused else "torch foreach"
        self.params = []
        for x, g in wl.unique:
            p = torch.nn.Parameter(torch.from_numpy(np.array(x, copy=True)))
            p.grad = torch.from_numpy(np.array(g, copy=True))
            self.params.append(p)
        kw = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.Adam(self.params, lr=LR, **kw)

    def step(self):
        self.opt.step()

    def state_bytes(self):
        total = 0
        for st in self.opt.state.values():
            for v in st.values():
                if hasattr(v, "element_size"):
                    total += v.numel() * v.element_size()
        return total


def make(name: str, wl) -> Candidate:
    if name.endswith(UNTIED):
        from . import workloads

        twin = wl.spec.get("twin")
        if twin is None:
            raise ValueError(f"{name!r}: workload {wl.name} has no untied twin")
        c = make(name[: -len(UNTIED)], workloads.build_cached(twin, quick=wl.quick))
        c.name = name
        return c
    if name == "optim eager":
        return OptimEager(wl)
    if name == "optim eager donate":
        return OptimEager(wl, donate=True)
    if name == "optim jit":
        return OptimJit(wl)
    if name == "optim jit xla":
        return OptimJitXla(wl)
    if name in WRAPPED:
        return OptimJitRule(wl, name) if name.startswith("optim") else OptaxRule(wl, name)
    if name == "optax":
        return Optax(wl)
    if name == "optax.flatten":
        return Optax(wl, flat=True)
    if name == "optax eager":
        return OptaxEager(wl)
    if name == "probe":
        return Probe(wl)
    if name == "torch foreach":
        return Torch(wl, fused=False)
    if name == "torch fused":
        return Torch(wl, fused=True)
    raise ValueError(f"unknown candidate {name!r}; choose from {ALL + ['optax eager'] + WRAPPED}")
