"""Interop with optax, both ways: `from_optax` runs an optax transformation as a tie-aware optim rule, and
`to_optax` turns an optim rule into an `optax.GradientTransformation` for an existing optax loop.

`from_optax(tx)` calls `tx.init` / `tx.update` once per real parameter (tie group), with that parameter's
array as the whole "params tree" and its summed gradient as the "updates tree". So ties, `None` gradients
(no step, state not advanced), `freeze` and per-path rules work with every optax optimiser. optax's updates
are added to the parameters and optim's steps are subtracted: the rule returns `-updates`.

This is right for every transformation that acts on each array independently (adam, sgd, lion, rmsprop,
adafactor, lamb / lars, muon, schedule_free, MultiSteps, masked with a callable mask, ...). A *whole-tree*
transformation computes something over all arrays together (a global norm, an inner product, an all-finite
test, a line search over the loss) and would silently compute per-array results instead. `from_optax` refuses
those when the rule is set up, naming the transformation: the known ones by name (`_WHOLE_TREE` in
`optax_checks.py`, which also catches the threshold-dependent ones), and any other by a traced dependency probe,
which is conservative (it refuses `optax.flatten` too; `check=False` skips it): `optax_probe.py` explains both
probes. Tie-aware
replacements: `optim.ClipGlobalNorm` for `clip_by_global_norm`, `optim.SkipNonFinite` for `apply_if_finite`;
for the rest (lbfgs, line searches, polyak_sgd, prodigy, dog, dadapt, mechanize, momo, sam, ...), run plain
optax on `optim.destructure(model)`'s flat vector, which holds each tied array once.

`from_optax` also probes the orientation of `tx`'s output: an optimiser's updates point against the gradient
(they are added), while a gradient transformation without its learning-rate stage (`optax.scale_by_adam()`,
`optax.clip(1.0)`) would climb the loss. Such a transformation is refused unless declared with
`gradient_like=True`, which makes the step `+updates`: a stage of an optim chain.

`to_optax(rule)`, the other way, is in `optim/_interop/to_optax.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._base.cache import memoize
from .optax_checks import WholeTreeError, check, is_transformation, label, normalise, transformation_name
from .._rules.fields import static
from .._rules.protocol import Rule
from .._rules.schedules import Schedule
from .._core.state import State
from .._base.tree import fmt_value, replace_fields

__all__ = ["from_optax", "with_extra_args", "FromOptax", "WholeTreeError"]


class FromOptax(Rule):
    """An optax transformation run on each parameter (tie group) separately; build it with `from_optax`.

    `tx` is the transformation, or a factory such as `optax.adam` whose numeric keyword arguments are fields of
    the rule (`lr` is passed as `learning_rate`), so `optim.adjust` and optim schedules reach them.
    `extra_args` holds the keyword arguments passed to every `tx.update` (`with_extra_args`).
    """

    tx: Any = static(None)
    extra_args: Any = None
    tree_args: tuple = static(())
    static_kwargs: tuple = static(())
    check: bool = static(True)
    gradient_like: bool = static(False)
    _hyper: ClassVar[tuple] = ()   # (field name, factory keyword) of the numeric factory arguments

    def transformation(self) -> Any:
        """The optax transformation, built from the current hyperparameters for a factory rule."""
        if is_transformation(self.tx):
            return normalise(self.tx)
        kw = {k: getattr(self, f) for f, k in self._hyper}
        return normalise(self.tx(**kw, **dict(self.static_kwargs)))

    def init(self, x):
        if self.check:
            check(self, x)
        return self.transformation().init(x)

    def apply(self, state, x, dx, *dxs):
        if len(dxs) != len(self.tree_args):
            raise TypeError(f"from_optax({label(self.tx)}): got {1 + len(dxs)} gradient trees but the rule takes "
                            f"1 + tree_args={self.tree_args!r}")
        kw = dict(self.extra_args or {})
        kw.update(zip(self.tree_args, dxs))
        updates, state = self.transformation().update(dx, state, x, **kw)
        updates = jnp.asarray(updates)
        return state, updates if self.gradient_like else -updates

    def __repr__(self):
        parts = [label(self.tx)]
        parts += [f"{f}={fmt_value(getattr(self, f))}" for f, _ in self._hyper]
        parts += [f"{k}={v!r}" for k, v in self.static_kwargs]
        if self.extra_args:
            parts.append(f"extra_args={{{', '.join(f'{k}: {fmt_value(v)}' for k, v in self.extra_args.items())}}}")
        if self.tree_args:
            parts.append(f"tree_args={self.tree_args!r}")
        if self.gradient_like:
            parts.append("gradient_like=True")
        return f"from_optax({', '.join(parts)})"


# 1024 sets of factory arguments: a program has a few. Far above real use, because an evicted class would make a
# later equal rule a new type (a new treedef: a recompile).
@memoize(1024)
def _factory_class(hyper: tuple[tuple[str, str], ...]) -> type:
    """A `FromOptax` subclass with one field per numeric factory argument (cached: equal rules, equal types)."""
    ns = {"__annotations__": {f: Any for f, _ in hyper}, "_hyper": hyper, "__module__": __name__,
          "__qualname__": "FromOptax"}
    ns.update({f: None for f, _ in hyper})
    return type("FromOptax", (FromOptax,), ns)


def _is_hyper(v: Any) -> bool:
    """A factory argument that becomes a (traced, adjustable) field: a float, a float array or a schedule."""
    if isinstance(v, Schedule):
        return True
    if isinstance(v, bool) or isinstance(v, (int, np.integer)):
        return False                     # counts, periods, flags: structural
    if isinstance(v, (float, np.floating)):
        return True
    if isinstance(v, (jax.Array, np.ndarray)):
        return jnp.issubdtype(v.dtype, jnp.inexact)
    if isinstance(v, tuple) and v and all(_is_hyper(u) for u in v):
        return True
    return False


def from_optax(tx: Any, /, *, extra_args: dict | None = None, tree_args: tuple[str, ...] = (),
               gradient_like: bool = False, check: bool = True, **hyperparameters: Any) -> FromOptax:
    """An optim rule that runs the optax transformation `tx` on each parameter (tie group) separately.

    `optim.from_optax(optax.adam(1e-3))` is Adam with ties, `None` gradients, `freeze` and per-path rules
    handled by optim: a tied parameter gets one optax state and one update from its summed gradient. The step
    is `-updates` (optax adds updates, optim subtracts steps). Each `tx.update(g, state, x)` sees one array as
    the whole tree, with the parameter's summed gradient (conjugated for complex parameters, as every optim
    rule sees it: the steepest-descent direction) and its value as `params`.

    Two forms:

    - `from_optax(optax.adam(1e-3))`: the transformation's hyperparameters are closed over: `optim.adjust`
      cannot reach them (use the second form, or an optax schedule, or `optax.inject_hyperparams`, whose values
      then live in each parameter's state: `state[path].state.hyperparams`).
    - `from_optax(optax.adam, lr=1e-3, b1=0.9)`: a factory and its keyword arguments. Float arguments (and
      arrays and optim schedules) become fields of the rule, so `optim.adjust(state, lr=1e-4, b1=0.8)` changes
      them without recompiling and an optim schedule is evaluated at optim's step; `lr` is passed to the factory
      as `learning_rate`. Integer, boolean and other arguments are structural (static). The factory is called
      again, with traced values, each time the update is traced.

    Extra arguments of `optax.GradientTransformationExtraArgs` (e.g. `value=loss` for
    `optax.contrib.reduce_on_plateau`) reach every `tx.update` as keywords: set them with
    `state = optim.with_extra_args(state, value=loss)` before `optim.update` (they stay until replaced), or pass
    them to `to_optax(rule).update(..., value=loss)` (for that call only). `extra_args={...}` gives their
    initial values (also used to check the transformation at setup). Per-parameter extra arguments shaped like the
    model travel as extra gradient trees: with `tree_args=("name",)`, `optim.update(state, model, grads, tree)`
    passes the tree's (tie-summed) entry for each parameter as `name=`.

    Whole-tree transformations (`clip_by_global_norm`, `apply_if_finite`, `lbfgs` and the line searches,
    `polyak_sgd`, `normalize_by_update_norm`, and contrib's `prodigy`, `dadapt_adamw`, `dog`, `dowg`,
    `mechanize`, `momo`, `sam`, ...) raise `WholeTreeError` (a `TypeError`) when the rule is set up: known ones
    by name, others by a traced dependency probe (`optim/_interop/optax_probe.py`). Use `optim.ClipGlobalNorm` and
    `optim.SkipNonFinite` instead of the first two. A transformation that needs a tree-shaped mask or label tree
    cannot be wrapped (use a callable mask).

    `tx` must be a complete optimiser: its updates are added to the parameters. A gradient transformation
    that keeps the gradient's orientation (`optax.scale_by_adam()`, `optax.clip(1.0)`, `reduce_on_plateau`)
    becomes a stage of an optim chain with `gradient_like=True` (step = `+updates`), e.g.
    `optim.chain(optim.from_optax(optax.scale_by_adam(), gradient_like=True), optim.Descent(1e-3))`; without
    it, setup refuses it (its first update points along the gradient). `check=False` skips both checks.

    >>> import jax.numpy as jnp, optax, optim
    >>> w = jnp.array([1.0, 2.0])
    >>> state = optim.setup(optim.from_optax(optax.sgd(0.1)), {"a": w, "b": w})
    >>> grads = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> state, m = optim.update(state, {"a": w, "b": w}, grads)
    >>> m["a"], m["a"] is m["b"]
    (Array([0.8, 1.8], dtype=float32), True)
    """
    if extra_args is not None and not isinstance(extra_args, dict):
        raise TypeError(f"from_optax: extra_args must be a dict of keyword arguments, got {type(extra_args).__name__}")
    tree_args = tuple(tree_args)
    if not all(isinstance(n, str) for n in tree_args):
        raise TypeError(f"from_optax: tree_args must be argument names, got {tree_args!r}")
    extra = {k: jnp.asarray(v) if isinstance(v, (int, float, np.number)) else v for k, v in (extra_args or {}).items()}
    try:
        hash(tx)
    except TypeError:
        raise TypeError(f"from_optax: {type(tx).__name__} is not hashable; the transformation is part of the "
                        f"compiled program's key") from None
    if is_transformation(tx):
        if hyperparameters:
            raise TypeError(f"from_optax: keyword arguments ({', '.join(hyperparameters)}) go with a factory such as "
                            f"optax.adam, not with an already built transformation ({transformation_name(tx)})")
        return FromOptax(tx, extra or None, tree_args, (), bool(check), bool(gradient_like))
    if not callable(tx):
        raise TypeError(f"from_optax: expected an optax GradientTransformation or a factory such as optax.adam, "
                        f"got {type(tx).__name__}")
    if "lr" in hyperparameters and "learning_rate" in hyperparameters:
        raise TypeError("from_optax: give lr or learning_rate, not both")
    hyper, static = [], []
    for k, v in hyperparameters.items():
        key = "learning_rate" if k == "lr" else k
        field = "lr" if key == "learning_rate" else k
        if field in {f.name for f in dataclasses.fields(FromOptax)}:
            raise TypeError(f"from_optax: the factory argument {k!r} clashes with a field of the rule")
        if key == "learning_rate" and isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            v = float(v)   # a learning rate is a float however it is written: adjustable, never truncated
        if _is_hyper(v):
            hyper.append((field, key, v))
        else:
            try:
                hash(v)
            except TypeError:
                raise TypeError(f"from_optax: factory argument {k}={v!r} is neither a number nor hashable "
                                f"(structural arguments are part of the compiled program's key)") from None
            static.append((key, v))
    try:
        sig = inspect.signature(tx)
    except (TypeError, ValueError):  # no signature to check against
        sig = None
    if sig is not None:
        try:
            sig.bind_partial(**{key: v for _, key, v in hyper}, **dict(static))
        except TypeError as e:
            raise TypeError(f"from_optax: {label(tx)} does not take these arguments: {e}") from None
    cls = _factory_class(tuple((f, key) for f, key, _ in hyper))
    rule = cls(tx, extra or None, tree_args, tuple(sorted(static)), bool(check), bool(gradient_like),
               *[v for _, _, v in hyper])
    try:
        built = rule.transformation()
    except TypeError as e:
        raise TypeError(f"from_optax: calling {label(tx)}(...) with these arguments failed: {e}") from e
    if not is_transformation(built):
        raise TypeError(f"from_optax: {label(tx)}(...) returned {type(built).__name__}, "
                        f"not an optax transformation")
    return rule


def _map_from_optax(rules: Any, f: Callable[[FromOptax], FromOptax]) -> Any:
    return jax.tree.map(lambda r: f(r) if isinstance(r, FromOptax) else r, rules,
                        is_leaf=lambda r: isinstance(r, FromOptax))


def _from_optax_rules(rules: Any) -> list[FromOptax]:
    return [r for r in jax.tree.leaves(rules, is_leaf=lambda r: isinstance(r, FromOptax)) if isinstance(r, FromOptax)]


def with_extra_args(state: State, **extra_args: Any) -> State:
    """Return `state` with keyword arguments for every `from_optax` rule's `tx.update` (optax's extra args,
    e.g. `value=loss`), merged with those it had. Numbers become arrays, so new values never recompile a
    jitted step while the set of names stays the same.

    >>> import jax.numpy as jnp, optax, optim
    >>> tx = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    >>> rule = optim.from_optax(tx, extra_args={"value": 0.0})
    >>> state = optim.setup(rule, {"w": jnp.ones(2)})
    >>> float(optim.with_extra_args(state, value=3.5)["w"].rule.extra_args["value"])
    3.5
    """
    if not isinstance(state, State):
        raise TypeError(f"with_extra_args: expected the State from optim.setup, got {type(state).__name__}")
    if not _from_optax_rules(state.rules):
        raise TypeError("with_extra_args: this state has no from_optax rule to pass extra arguments to")
    new = {k: jnp.asarray(v) if isinstance(v, (int, float, np.number)) else v for k, v in extra_args.items()}

    def put(r: FromOptax) -> FromOptax:
        merged = dict(r.extra_args or {})
        for k, v in new.items():
            o = merged.get(k)
            same = isinstance(o, jax.Array) and isinstance(v, jax.Array) and o.shape == v.shape
            merged[k] = v.astype(o.dtype) if same else v    # keep the abstract type: no retrace
        return replace_fields(r, {"extra_args": merged or None})

    return state.replace(rules=_map_from_optax(state.rules, put))

