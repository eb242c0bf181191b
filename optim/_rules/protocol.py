"""The rule protocol: what a rule is, what a rule's step is, and how rules run over parameters.

A rule is `init(x) -> state` and `apply(state, x, dx, *dxs) -> (state, step)` over one parameter `x`; the new
parameter is `x - step` (`apply_step`). Besides a plain array, a step may be `None` (no step), `Gated` (a step
only where a flag is true) or `Replace` (the new value itself).

`Rule` is the base class of the built-in rules: a frozen dataclass registered as a pytree whose hyperparameters
are leaves, so changing one with `optim.adjust` changes data, never the compiled program. Fields declared
`static` (or `flag`, see `fields.py`) are structural (they change the state's shape or the program) and live in
the treedef instead.

`update` runs a rule over *stacks* of parameters (a group of same-shaped parameters stacked on a leading axis)
with `apply_all`: rules that look across parameters implement `apply_tree` over such stacks, every other rule's
`apply` is vmapped. Such a rule's own `apply` is `apply_one` (a stack of one).

The helpers below (`as_compute`, `eps_of`, `abs2`, ...) are the building blocks of the formulas in
the rules of `optim._rules` (public within the package): rules compute in the parameter's real dtype, but at
least float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import fields as _fields
from . import hyper as _hyper
from .._base.tree import register_struct, struct_repr

__all__ = ["Rule", "Gated", "Replace", "apply_step", "apply_all", "apply_one", "step_row", "average_of",
           "sum_squares", "gate_state", "skip_unless"]


# ----------------------------------------------------------------------------------------------- steps
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gated:
    """A step that only happens where `ok` is true (branch-free "maybe no step", e.g. from `AccumGrad`).

    A chain that receives a `Gated` step keeps the state of every later stage unchanged where `ok` is false.

    >>> import jax.numpy as jnp, optim
    >>> closed = optim.Gated(jnp.array([0.5, 0.5]), jnp.array(False))
    >>> optim.apply_step(jnp.array([1.0, 2.0]), closed)
    Array([1., 2.], dtype=float32)
    """

    step: Any
    ok: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Replace:
    """Not a step but the new value of the parameter itself (used by `MixedPrecision`).

    >>> import jax.numpy as jnp, optim
    >>> new = optim.Replace(jnp.array([5.0, 6.0]))
    >>> optim.apply_step(jnp.array([1.0, 2.0]), new)
    Array([5., 6.], dtype=float32)
    """

    value: jax.Array


def apply_step(x: jax.Array, step: Any) -> jax.Array:
    """`x - step`, keeping `x`'s dtype; understands `None` (no step), `Gated` and `Replace`.

    >>> import jax.numpy as jnp, optim
    >>> optim.apply_step(jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0]))
    Array([0.5, 3. ], dtype=float32)
    """
    if step is None:
        return x
    if isinstance(step, Replace):
        return step.value.astype(x.dtype)
    if isinstance(step, Gated):
        return where_leading(step.ok, apply_step(x, step.step), x)
    return (x - step).astype(x.dtype)


def where_leading(ok: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.where` with `ok` aligned on the leading axes: a stacked group's gate has one entry per member."""
    ok = jnp.asarray(ok)
    return where(ok.reshape(ok.shape + (1,) * (jnp.ndim(a) - ok.ndim)), a, b)


def _split_type(a: Any) -> Any:
    """`a`'s sharding when it is part of its type and splits it (Explicit mesh axes), else None."""
    s = getattr(jax.typeof(a), "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and not s.mesh.empty and any(d is not None for d in s.spec):
        return s
    return None


def where(c: Any, a: Any, b: Any) -> jax.Array:
    """`jnp.where(c, a, b)`, also where shardings are types (Explicit mesh axes) and the operands differ: with
    ZeRO-1 a rule's state is split and its gradient and parameter are replicated, and JAX's select refuses
    operands sharded differently ("select cases must have the same shardings"). They are then broadcast and
    resharded to the split one (a replicated operand is sliced: no communication)."""
    ops = [jnp.asarray(v) for v in (c, a, b)]
    want = next((s for s in map(_split_type, ops) if s is not None), None)
    if want is None or all(jnp.ndim(v) == 0 or _split_type(v) == want for v in ops):
        return jnp.where(c, a, b)
    ops = [v if jax.typeof(v).sharding.spec == want.spec else jax.sharding.reshard(v, want)
           for v in jnp.broadcast_arrays(*ops)]
    return jnp.where(*ops)


# ----------------------------------------------------------------------------------------------- base
class Rule:
    """Base class of optimisation rules.

    Subclasses are frozen dataclasses; `__init_subclass__` registers each as a pytree whose leaves are the
    non-static fields. A user-defined rule needs only `init` and `apply` (and may skip subclassing).

    Each field declares its contract with its default, from `optim.fields`: `nonneg(0.1)` (finite, >= 0),
    `unit` (in [0, 1)), `decay` (in [0, 1]), `signed` (finite), `count` (an integer >= 1), `steps` (an
    integer >= 0), `static` (structural, in the treedef) and `flag` (a static bool); a plain default declares
    none. The constructor checks concrete values and stores numbers as
    floats, so `adjust` never truncates one given as an int. A tuple default makes the field a tuple of that
    many numbers, each checked alike: `unit((0.9, 0.999))` a pair, `unit((0.9, 0.99, 0.999))` a triple.
    A subclass that gives a field a plain new default keeps its contract. The class tuples below are derived
    from the fields; a class that sets one itself (`_nonneg = ("lr",)`, the form before the field markers) is
    refused with a `TypeError` that gives the field form.

    >>> import jax.numpy as jnp, optim
    >>> class Sign(optim.Rule):
    ...     lr: float = optim.fields.nonneg(0.1)
    ...     def apply(self, state, x, dx, *dxs):
    ...         return state, self.lr * jnp.sign(dx)
    >>> x = jnp.array([1.0, 2.0])
    >>> optim.update(optim.setup(Sign(1), x), x, jnp.array([0.5, -3.0]))[1]
    Array([0., 3.], dtype=float32)
    >>> Sign(-1.0)
    Traceback (most recent call last):
    ...
    ValueError: Sign: lr must be >= 0 and finite, got -1.0
    """

    # Derived per subclass from its fields' contracts (`optim._rules.fields`); never set by hand.
    _static: ClassVar[tuple[str, ...]] = ()
    _nonneg: ClassVar[tuple[str, ...]] = ()   # finite and >= 0
    _initial: ClassVar[tuple[str, ...]] = ()  # read only by init (in `_nonneg` too): no schedule
    _unit: ClassVar[tuple[str, ...]] = ()     # each component in [0, 1) (decay rates that bias-correct: beta)
    _decay: ClassVar[tuple[str, ...]] = ()    # in [0, 1] (rho)
    _signed: ClassVar[tuple[str, ...]] = ()   # finite, any sign (Scale.f)
    _counts: ClassVar[tuple[str, ...]] = ()   # integers >= 1, kept integers (AccumGrad.n)
    _steps: ClassVar[tuple[str, ...]] = ()    # numbers of steps: integers >= 0, kept integers (a warmup)
    _flags: ClassVar[tuple[str, ...]] = ()    # structural switches (in `_static`): True or False
    # Set per subclass: the fields whose default is a tuple, with that default (its length is the field's).
    _tuples: ClassVar[dict[str, tuple]] = {}
    # Whether the rule looks across the parameters that share it (`ClipGlobalNorm`: True); None for a rule that
    # does not say, which counts as True when it has `apply_tree` (see `looks_across`).
    _across: ClassVar[bool | None] = None
    # The name of the standard per-element formula the rule's `apply` computes ("adam", "lion", ...), for the
    # engine's strategies that run formulas by name (optim._engine.fused); read from the class itself, not inherited, so
    # a subclass that changes `apply` does not claim it (`formula_of`).
    _formula: ClassVar[str | None] = None
    # Whether the rule's parameters are stacked whatever their size (`optim._engine.stack.make_stacks` keeps large
    # ones alone otherwise): a rule whose step is matrix work per parameter (SOAP's eigh and qr) then runs it
    # batched, once per shape, at the cost of a copy of each parameter into its stack (see `stacks_large`).
    _stack_large: ClassVar[bool] = False
    # Whether the rule's large parameters are stacked where they live on a mesh of several devices (`Muon`): its
    # `apply_tree` splits a stack's per-matrix work across them (optim._rules.split), which needs a stack.
    _split_large: ClassVar[bool] = False
    # Whether XLA's path may split the rule's step per stack to run its scalar arithmetic once per pack
    # (`optim._engine.hoist`); False: its `apply_tree` gets all its stacks at once (SOAP orders their eigh / qr).
    _hoist: ClassVar[bool] = True
    # Whether `apply_tree` takes an outer scalar gate `ok=` (`skip_unless`'s selects): a rule whose state reads its
    # own new parameter (`EMA`) then reads the gated value the parameter is updated to.
    _gate: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = _fields.declared(cls)     # read before the dataclass replaces each `Field` by its default
        try:
            dataclasses.dataclass(frozen=True, repr=False)(cls)
        except TypeError as e:          # e.g. a contract on a name without an annotation: say which class
            raise TypeError(f"{cls.__name__}: {e}") from None
        fields = dataclasses.fields(cls)
        for attr, names in _fields.contract_tuples(cls, own, [f.name for f in fields]).items():
            setattr(cls, attr, names)
        register_struct(cls, cls._static)
        # Fields with a tuple default (`beta`) and their lengths: found once per class, not per construction.
        cls._tuples = {f.name: f.default for f in fields if isinstance(f.default, tuple)}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name not in self._static:
                object.__setattr__(self, f.name, self._checked(f.name, getattr(self, f.name)))
        for name in self._flags:    # a string such as "no" would be true: refuse anything but a bool
            object.__setattr__(self, name, _hyper.flag(type(self).__name__, name, getattr(self, name)))

    @classmethod
    def _checked(cls, name: str, v: Any) -> Any:
        """`v` checked and in stored form for the field `name` (used by the constructor and by `adjust`)."""
        owner = cls.__name__
        if name in cls._counts or name in cls._steps:
            return _hyper.count(owner, name, v, minimum=0 if name in cls._steps else 1)
        check = ("unit" if name in cls._unit else "closed_unit" if name in cls._decay
                 else "nonneg" if name in cls._nonneg else "any" if name in cls._signed else None)
        if check is None:   # a field this class does not declare (a user rule's): only make integers floating
            return float(v) if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else v
        if name in cls._initial and _hyper.is_schedule(v):
            raise TypeError(f"{owner}: {name} is read once, by init, so a schedule's values after step 0 would "
                            f"never be read; give a number (got {v!r})")
        if name in cls._tuples:
            return _hyper.numbers(owner, name, v, check, cls._tuples[name])
        return _hyper.hyper(owner, name, v, check)

    def init(self, x: jax.Array) -> Any:
        """The state for one parameter `x` (`None` for a stateless rule)."""
        return None

    def apply(self, state: Any, x: jax.Array, dx: jax.Array, *dxs: jax.Array) -> tuple[Any, Any]:
        """Return `(new_state, step)`; the parameter becomes `x - step`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return struct_repr(self)


# ----------------------------------------------------------------------------------------------- helpers
def real_dtype(x: jax.Array):
    """The real dtype of `x` (float32 for complex64)."""
    return jnp.finfo(x.dtype).dtype


def compute_dtype(x: jax.Array):
    """The dtype rules compute in: the parameter's real dtype, but at least float32 (in bfloat16 β₂ = 0.999
    rounds to 1 and Adam's bias correction divides by zero). States keep their own storage dtype."""
    return jnp.promote_types(real_dtype(x), jnp.float32)


def as_compute(v: Any, x: jax.Array) -> jax.Array:
    """A hyperparameter as an array in the compute dtype of the parameter `x` (Optimisers.jl casts to the
    parameter's dtype; here at least float32, see `compute_dtype`)."""
    return jnp.asarray(v, dtype=compute_dtype(x))


def eps_of(eps: Any, x: jax.Array) -> jax.Array:
    """ε in the parameter's compute dtype, at least 1e-7 for 16-bit floats (Optimisers.jl #167)."""
    e = as_compute(eps, x)
    if jnp.finfo(x.dtype).bits <= 16:
        e = jnp.maximum(e, jnp.asarray(1e-7, e.dtype))
    return e


def abs2(g: jax.Array) -> jax.Array:
    """`|g|²`, real also for complex `g`."""
    return jnp.real(g * jnp.conj(g)) if jnp.iscomplexobj(g) else g * g


def sum_squares(a: jax.Array, axis: Any = None) -> jax.Array:
    """`Σ|a|²` over `axis` (every axis by default), accumulated in float32 or wider (each square in `a`'s dtype):
    what the norms of `ClipGlobalNorm` and `update(..., return_stats=True)` add up."""
    return jnp.sum(abs2(a).astype(jnp.promote_types(real_dtype(a), jnp.float32)), axis=axis)


def widened(a: jax.Array, dtype: Any) -> jax.Array:
    """`a`, a value just rounded to a narrower floating dtype (a new bfloat16 parameter), as `dtype`, its rounding
    kept. XLA allows excess precision by default: a round trip such as float32 -> bfloat16 -> float32 inside one
    fused loop may be dropped (XLA:GPU does), so code that compares the stored value with a wider one (the update
    norm, an average of the new parameter) would see the unrounded value. `reduce_precision` to `a`'s own
    format, applied in the wider dtype, is an operation XLA keeps."""
    out = a.astype(dtype)
    if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.finfo(a.dtype).bits >= jnp.finfo(out.dtype).bits:
        return out
    info = jnp.finfo(a.dtype)
    return jax.lax.reduce_precision(out, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def zeros_real(x: jax.Array) -> jax.Array:
    """Zeros of `x`'s shape in its real dtype (second moments of a complex parameter are real)."""
    return jnp.zeros(x.shape, real_dtype(x))


def tuple_of(values: Any, x: jax.Array) -> tuple[jax.Array, ...]:
    """A tuple hyperparameter (`beta`, Rprop's `ell` and `gamma`) as arrays in the compute dtype of `x`, one per
    number."""
    return tuple(as_compute(v, x) for v in values)


def pair_of(pair: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A pair hyperparameter (`beta`, Rprop's `ell` and `gamma`) as two arrays in the compute dtype of `x`; a
    tuple of another length is refused (a rule with three decay rates takes them with `tuple_of`)."""
    if len(pair) != 2:
        raise ValueError(f"pair_of: expected a pair of numbers, got {len(pair)}: {pair!r}; a rule with "
                         f"{len(pair)} of them reads them with tuple_of")
    return as_compute(pair[0], x), as_compute(pair[1], x)


# ----------------------------------------------------------------------------------------------- executor
def clip_factor(max_norm: jax.Array, norm: jax.Array) -> jax.Array:
    """`min(max_norm / norm, 1)`, but exactly 1 when the norm is within bounds: a zero gradient with
    `max_norm = 0` would otherwise give 0 / 0 = NaN. A NaN norm still gives NaN (a NaN step, not a silently
    unclipped one)."""
    ok = norm <= max_norm
    return jnp.where(ok, 1, max_norm / jnp.where(ok, 1, norm)).astype(max_norm.dtype)


def average_of(rule: Any, state: Any, x: jax.Array) -> Any:
    """The value to evaluate parameter `x` with, from `rule`'s state: what `optim.averaged` returns for it, or
    `None` when the rule keeps no average. A rule that keeps one (`EMA`) defines `average(state, x)`; rules
    that wrap another delegate to it."""
    average = getattr(rule, "average", None)
    return None if average is None else average(state, x)


def is_rule(v: Any) -> bool:
    """Whether `v` is a rule: it has `init(x)` and `apply(state, x, dx, *dxs)` (subclassing `Rule` is optional)."""
    return callable(getattr(v, "init", None)) and callable(getattr(v, "apply", None))


def apply_all(rule: Any, states: list, xs: list, dxs: list) -> tuple[list, list]:
    """Run `rule` on several *stacks* of parameters at once. Entry `i` is a group of parameters stacked on a
    leading axis: `xs[i]`, its states `states[i]` (stacked alike) and `dxs[i]`, the tuple of its gradients.

    Rules that look across parameters (`ClipGlobalNorm`, `SkipNonFinite`, chains containing them) implement
    `apply_tree(states, xs, dxs)` over such stacks; every other rule's per-parameter `apply` is vmapped over
    each stack, which computes exactly what a loop over the parameters would.

    >>> import jax.numpy as jnp, optim
    >>> # one stack of two parameters
    >>> xs = [jnp.array([[1.0, 2.0], [3.0, 4.0]])]
    >>> grads = [(jnp.ones((2, 2)),)]
    >>> states, steps = optim.apply_all(optim.Descent(0.5), [None], xs, grads)
    >>> steps[0]
    Array([[0.5, 0.5],
           [0.5, 0.5]], dtype=float32)
    """
    if hasattr(rule, "apply_tree"):
        return rule.apply_tree(states, xs, dxs)
    out = [jax.vmap(rule.apply)(s, x, *d) for s, x, d in zip(states, xs, dxs)]
    return [o[0] for o in out], [o[1] for o in out]



def gate_state(new: Any, old: Any, ok: Any) -> Any:
    """`new` where `ok` (no gate: `None`), else `old`, leaf by leaf: the state of a stage after a `Gated` step."""
    return new if ok is None else jax.tree.map(lambda a, b: where_leading(ok, a, b), new, old)


def skip_unless(ok: jax.Array, rule: Any, states: list, xs: list, dxs: list) -> tuple[list, list]:
    """`apply_all(rule, states, xs, dxs)` where the scalar `ok` is true; else the states unchanged and steps that
    the caller gates (`Gated(step, ok)`).

    On CPU a conditional: selecting between the new state and the old one makes XLA:CPU keep the old state
    alive past the loop that overwrites it in place, a copy of every state array per step (Adam: 3 copies per
    parameter; with the conditional none; timings in `bench/NOTES.md`). Elsewhere branch-free selects, which XLA
    fuses into the rule's own loops there and which need no predicate on the host (a GPU conditional reads it
    back every step). Under `vmap` (a batched `ok`) JAX turns the conditional into the same selects."""
    def run(states, xs, dxs, gate=None):
        # A rule that takes the gate (`Rule._gate`: EMA) reads the gated new parameter (`EMA.apply_tree`).
        new, steps = (rule.apply_tree(states, xs, dxs, ok=gate) if gate is not None and getattr(rule, "_gate", False)
                      else apply_all(rule, states, xs, dxs))
        # The branches must agree on dtypes: a rule computing in float32 keeps a bfloat16 state bfloat16.
        new = [n if jax.tree.structure(n) != jax.tree.structure(o) else
               jax.tree.map(lambda a, b: jnp.asarray(a, jnp.result_type(b)), n, o) for n, o in zip(new, states)]
        return new, steps

    def skip(states, xs, dxs):
        shapes = jax.eval_shape(run, states, xs, dxs)[1]
        return states, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def branch(states, xs, dxs):
        return jax.lax.cond(ok, run, skip, states, xs, dxs)

    def select(states, xs, dxs):
        new, steps = run(states, xs, dxs, ok)
        return [gate_state(n, o, ok) for n, o in zip(new, states)], steps

    return jax.lax.platform_dependent(states, xs, dxs, cpu=branch, default=select)

def apply_one(rule: Any, state: Any, x: jax.Array, dxs: tuple) -> tuple[Any, Any]:
    """`rule.apply` for one parameter, in terms of `rule.apply_tree` (a stack of one): the `apply` of rules that
    are defined over stacks."""
    def lead(t):
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), t)

    states, steps = rule.apply_tree([lead(state)], [lead(x)], [lead(tuple(dxs))])
    return jax.tree.map(lambda a: a[0], states[0]), step_row(steps[0], 0)


def step_row(step: Any, m: int) -> Any:
    """Member `m`'s part of a stacked step (plain, `Gated` or `Replace`). A 0-d entry (a gate shared by the
    whole stack, as `SkipNonFinite` returns) has no row to take and applies to every member."""
    return jax.tree.map(lambda a: a if jnp.ndim(a) == 0 else a[m], step)


def looks_across(rule: Any) -> str | None:
    """The name of the first part of `rule` that looks across the parameters sharing it (`ClipGlobalNorm`,
    `SkipNonFinite`, `SkipLargeUpdates`, a user rule with `apply_tree`), or None. Giving some of those parameters a
    rule of their own would change what it computes for all of them."""
    own = getattr(rule, "_across", None)
    if own or (own is None and hasattr(rule, "apply_tree")):
        return type(rule).__name__
    for r in inner_rules(rule):
        found = looks_across(r)
        if found:
            return found
    return None


def inner_fields(rule: Any) -> list[str]:
    """The fields of `rule` that hold rules (`SkipNonFinite.rule`, `OptimiserChain.rules`), which `adjust` and
    `looks_across` go inside."""
    if not dataclasses.is_dataclass(rule):
        return []
    out = []
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        if is_rule(v) or (isinstance(v, tuple) and v and all(map(is_rule, v))):
            out.append(f.name)
    return out


def inner_rules(rule: Any) -> list:
    """The rules held in `rule`'s `inner_fields`, in field order (a chain's stages in order)."""
    out: list = []
    for name in inner_fields(rule):
        v = getattr(rule, name)
        out += v if isinstance(v, tuple) else [v]
    return out


def stacks_large(rule: Any) -> bool:
    """Whether `rule`, or a rule inside it (a chain's stage, a wrapper's rule), asks for its large parameters
    to be stacked (`Rule._stack_large`)."""
    if getattr(rule, "_stack_large", False):
        return True
    return any(stacks_large(r) for r in inner_rules(rule))


def splits_large(rule: Any) -> bool:
    """Whether `rule`, or a rule inside it, asks for its large parameters to be stacked on a mesh of several
    devices (`Rule._split_large`)."""
    if getattr(rule, "_split_large", False):
        return True
    return any(splits_large(r) for r in inner_rules(rule))


def formula_of(rule: Any) -> str | None:
    """The per-element formula `rule`'s own class declares (`Rule._formula`; not inherited), or None."""
    return type(rule).__dict__.get("_formula")
