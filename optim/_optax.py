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
those when the rule is set up, naming the transformation: the known ones by name (`_WHOLE_TREE`, which also
catches the threshold-dependent ones), and any other by a traced dependency probe, which is conservative (it
refuses `optax.flatten` too; `check=False` skips it): `optim/_optax_probe.py` explains both probes. Tie-aware
replacements: `optim.ClipGlobalNorm` for `clip_by_global_norm`, `optim.SkipNonFinite` for `apply_if_finite`;
for the rest (lbfgs, line searches, polyak_sgd, prodigy, dog, dadapt, mechanize, momo, sam, ...), run plain
optax on `optim.destructure(model)`'s flat vector, which holds each tied array once.

`from_optax` also probes the orientation of `tx`'s output: an optimiser's updates point against the gradient
(they are added), while a gradient transformation without its learning-rate stage (`optax.scale_by_adam()`,
`optax.clip(1.0)`) would climb the loss. Such a transformation is refused unless declared with
`gradient_like=True`, which makes the step `+updates`: a stage of an optim chain.

`to_optax(rule)`, the other way, is in `optim/_to_optax.py` (imported here).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any, Callable, ClassVar, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ._cache import LRU, memoize
from ._optax_probe import cross_leaf, update_orientation
from ._step import Rule
from ._schedules import Schedule
from ._state import State
from ._tree import fmt_value, replace_fields

__all__ = ["from_optax", "to_optax", "with_extra_args", "FromOptax", "WholeTreeError"]


class WholeTreeError(TypeError):
    """An optax transformation that looks at the whole tree was given to `from_optax`."""


_DESTRUCTURE = ("run it with plain optax on the deduplicated parameters instead: `flat, rebuild = "
                "optim.destructure(model)` holds each tied array once, and the loss of `rebuild(flat)` has the "
                "summed gradient")

# optax transformations (the function that builds them) that combine all arrays of the tree, and what to use.
_WHOLE_TREE: dict[str, str] = {
    "clip_by_global_norm": "use optim.ClipGlobalNorm(max_norm) before it in an optim.chain, e.g. "
                           "optim.chain(optim.ClipGlobalNorm(1.0), optim.from_optax(optax.adam(1e-3))): it counts "
                           "each tied parameter once, with its summed gradient",
    "per_example_global_norm_clip": "clip the per-example gradients before calling optim.update",
    "differentially_private_aggregate": "clip the per-example gradients before calling optim.update",
    "apply_if_finite": "use optim.SkipNonFinite(rule), which skips the whole step",
    "skip_not_finite": "use optim.SkipNonFinite(rule), which skips the whole step",
    "skip_large_updates": _DESTRUCTURE,
    "normalize_by_update_norm": _DESTRUCTURE,
    "scale_by_polyak": _DESTRUCTURE,
    "scale_by_lbfgs": _DESTRUCTURE,
    "scale_by_zoom_linesearch": _DESTRUCTURE,
    "scale_by_backtracking_linesearch": _DESTRUCTURE,
    "scale_by_dowg": _DESTRUCTURE,
    "dadapt_adamw": _DESTRUCTURE,
    "prodigy": _DESTRUCTURE,
    "mechanize": _DESTRUCTURE,
    "momo": _DESTRUCTURE,
    "momo_adam": _DESTRUCTURE,
    "sam": _DESTRUCTURE,
    "normalize": _DESTRUCTURE,          # optax.contrib's, used by sam
}


# ------------------------------------------------------------------------------------------ from_optax
def _optax():
    try:
        import optax
    except ImportError as e:  # optax is not a dependency of optim itself
        raise ImportError("optim's optax interop needs optax: pip install optax") from e
    return optax


def _normalise(tx: Any) -> Any:
    """Any optax transformation as one whose `update` accepts extra keyword arguments."""
    optax = _optax()
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return tx
    if hasattr(tx, "gradient_transformation"):          # optax.MultiSteps
        return tx.gradient_transformation()
    if isinstance(tx, optax.GradientTransformation):
        return optax.with_extra_args_support(tx)
    return tx


def _is_transformation(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def _root_name(fn: Any) -> str | None:
    """`'clip_by_global_norm'` for optax's `clip_by_global_norm.<locals>.update_fn`; None for non-optax code."""
    mod = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None)
    if not mod.startswith("optax") or not isinstance(qual, str):
        return None
    return qual.split(".<locals>")[0].split(".")[0]


def _reachable(root: Any, max_depth: int, *, attributes: bool = True,
               stop: Callable[[Any], bool] = lambda obj: False) -> Iterator[Any]:
    """`root` and the objects reachable from it, depth-first, each once (cycles end), at most `max_depth` steps
    away. optax builds a transformation as functions closing over its settings and inner transformations, so the
    steps are: a function's closure cells, a tuple's or list's items, a dict's values and, with `attributes`, a
    bound method's instance, a partial's function and arguments and an optax object's attributes. An object for
    which `stop` is true is yielded but not looked inside."""
    seen: set = set()

    def walk(obj: Any, depth: int) -> Iterator[Any]:
        if depth > max_depth or id(obj) in seen:
            return
        seen.add(id(obj))
        yield obj
        if not stop(obj):
            for part in _parts(obj, attributes):
                yield from walk(part, depth + 1)

    return walk(root, 0)


def _parts(obj: Any, attributes: bool) -> Iterator[Any]:
    """The objects one step inside `obj`, for `_reachable`."""
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        if attributes and isinstance(obj, types.MethodType):
            yield obj.__self__
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield contents
    elif isinstance(obj, (tuple, list)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif not attributes:
        return
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from (*obj.args, *obj.keywords.values())
    elif _is_optax_object(obj):
        yield from vars(obj).values()


def _is_optax_object(obj: Any) -> bool:
    """An instance of a class of optax's with attributes (`MultiSteps`, ...), not a container or partial."""
    return (not isinstance(obj, (functools.partial, tuple, list, dict))
            and (type(obj).__module__ or "").startswith("optax") and hasattr(obj, "__dict__"))


def _optax_names(tx: Any) -> list[str]:
    """Names of the optax builders reachable from a transformation (through closures, chains, wrappers): each
    function's builder (`_root_name`) and each optax object's class."""
    names: list[str] = []
    for obj in _reachable(tx, 10):
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            name = _root_name(obj.__func__ if isinstance(obj, types.MethodType) else obj)
            if name is not None:
                names.append(name)
        elif _is_optax_object(obj):
            names.append(type(obj).__name__)
    return names


def _components(tx: Any) -> list[Any]:
    """The transformations directly inside `tx` (a chain's stages, a wrapper's inner transformation): those
    reachable from `tx.update` through closures and containers, not looking inside them."""
    def inner(obj: Any) -> bool:
        return _is_transformation(obj) and not isinstance(obj, type)

    return [obj for obj in _reachable(getattr(tx, "update", None), 3, attributes=False, stop=inner) if inner(obj)]


def _transformation_name(tx: Any) -> str:
    """A readable name for a transformation: the optax builder that made it, else its type."""
    upd = getattr(tx, "update", None)
    fn = upd.__func__ if isinstance(upd, types.MethodType) else upd
    qual = getattr(fn, "__qualname__", None)
    if isinstance(upd, types.MethodType):
        return type(tx).__name__
    if isinstance(qual, str):
        return qual.split(".<locals>")[0]
    return type(tx).__name__


def _describe(tx: Any) -> str:
    """`chain(scale_by_adam, scale_by_learning_rate)` for `optax.adam(...)`."""
    name = _transformation_name(tx)
    if name in ("chain", "named_chain"):
        return f"{name}({', '.join(_describe(c) for c in _components(tx))})"
    return name


# 1024 checks (per transformation and dtype, and per number of dimensions): a model needs a few; a miss only
# runs the probes again.
_CHECKED = LRU(1024)


def _check(rule: "FromOptax", x: Any) -> None:
    """Refuse whole-tree transformations and gradient-like ones not declared so (see `from_optax`). The
    dependency check runs once per transformation, dtype and number of dimensions, the orientation check (one
    small compiled update) once per transformation and dtype; both also while `setup` traces `init`."""
    base = (rule.tx, rule.static_kwargs, rule.gradient_like, jnp.dtype(x.dtype))
    key = base + (len(x.shape),)
    if _CHECKED.get(key):
        return
    with jax.ensure_compile_time_eval():   # build and probe concretely
        _check_now(rule, rule.transformation(), x, orient=not _CHECKED.get(base))
    _CHECKED[key] = _CHECKED[base] = True


def _label(tx: Any) -> str:
    """How messages and reprs name a wrapped transformation or factory."""
    if _is_transformation(tx):
        return _describe(tx)
    return getattr(tx, "__name__", None) or getattr(getattr(tx, "func", None), "__name__", None) or repr(tx)


def _check_now(rule: "FromOptax", tx: Any, x: Any, orient: bool = True) -> None:
    name = _label(rule.tx)
    known = [n for n in _optax_names(tx) if n in _WHOLE_TREE]
    if known:
        inside = "" if known[0] == name else f" (inside {name})"
        raise WholeTreeError(f"from_optax: optax's {known[0]}{inside} works on the whole tree, but from_optax runs "
                             f"the transformation on each parameter separately, so it would silently compute "
                             f"per-parameter results; {_WHOLE_TREE[known[0]]}")
    shape = tuple(x.shape) if int(np.prod(x.shape)) > 0 else (3,)
    extra = dict(rule.extra_args or {})
    args = (shape, x.dtype, extra, rule.tree_args)
    try:
        cross = cross_leaf(tx, *args)
        orientation = update_orientation(tx, *args) if orient else 0
    except Exception as e:  # the transformation cannot run on single arrays (or needs extra arguments)
        raise TypeError(
            f"from_optax: could not run {name} on single parameters to check that it works per parameter "
            f"({type(e).__name__}: {e}). If it needs extra arguments, give example values with "
            f"extra_args={{...}}; a transformation that needs the whole tree (a loss function, a tree-shaped "
            f"mask or label tree) cannot be wrapped; check=False skips this check") from e
    if cross:
        culprit = name
        for c in _components(tx):
            try:
                if cross_leaf(_normalise(c), *args):
                    culprit = f"{_label(c)} (inside {name})"
                    break
            except Exception:
                continue
        raise WholeTreeError(
            f"from_optax: {culprit} combines the arrays of the tree (one array's update depends on another's "
            f"values, gradient or state), but from_optax runs it on each parameter separately, so it would "
            f"silently compute per-parameter results; {_DESTRUCTURE}. check=False skips this check (for a "
            f"transformation that only reshapes the tree, such as optax.flatten, wrap its inner one instead)")
    if orientation > 0 and not rule.gradient_like:
        raise TypeError(
            f"from_optax: {name}'s updates point along the gradient, so adding them to the parameters would climb "
            f"the loss: it is a gradient transformation without the final learning-rate stage (like "
            f"optax.scale_by_adam() or optax.clip(1.0)). Give a complete optimiser (e.g. optax.chain(tx, "
            f"optax.scale_by_learning_rate(lr)) or optax.adam(lr)), or, to use it as a stage of an optim chain "
            f"whose step is its output, pass gradient_like=True (check=False skips this check)")
    if orientation < 0 and rule.gradient_like:
        raise TypeError(
            f"from_optax: {name}'s updates point against the gradient (a complete optimiser such as optax.adam(lr), "
            f"whose updates are added to the parameters), but gradient_like=True says they point along it; "
            f"drop gradient_like=True (check=False skips this check)")


class FromOptax(Rule):
    """An optax transformation run on each parameter (tie group) separately; build it with `from_optax`.

    `tx` is the transformation, or a factory such as `optax.adam` whose numeric keyword arguments are fields of
    the rule (`lr` is passed as `learning_rate`), so `optim.adjust` and optim schedules reach them.
    `extra_args` holds the keyword arguments passed to every `tx.update` (`with_extra_args`).
    """

    tx: Any = None
    extra_args: Any = None
    tree_args: tuple = ()
    static_kwargs: tuple = ()
    check: bool = True
    gradient_like: bool = False
    _static = ("tx", "tree_args", "static_kwargs", "check", "gradient_like")
    _hyper: ClassVar[tuple] = ()   # (field name, factory keyword) of the numeric factory arguments

    def transformation(self) -> Any:
        """The optax transformation, built from the current hyperparameters for a factory rule."""
        if _is_transformation(self.tx):
            return _normalise(self.tx)
        kw = {k: getattr(self, f) for f, k in self._hyper}
        return _normalise(self.tx(**kw, **dict(self.static_kwargs)))

    def init(self, x):
        if self.check:
            _check(self, x)
        return self.transformation().init(x)

    def apply(self, state, x, dx, *dxs):
        if len(dxs) != len(self.tree_args):
            raise TypeError(f"from_optax({_label(self.tx)}): got {1 + len(dxs)} gradient trees but the rule takes "
                            f"1 + tree_args={self.tree_args!r}")
        kw = dict(self.extra_args or {})
        kw.update(zip(self.tree_args, dxs))
        updates, state = self.transformation().update(dx, state, x, **kw)
        updates = jnp.asarray(updates)
        return state, updates if self.gradient_like else -updates

    def __repr__(self):
        parts = [_label(self.tx)]
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
    by name, others by a traced dependency probe (`optim/_optax_probe.py`). Use `optim.ClipGlobalNorm` and
    `optim.SkipNonFinite` instead of the first two. A transformation that needs a tree-shaped mask or label tree
    cannot be wrapped (use a callable mask).

    `tx` must be a complete optimiser: its updates are added to the parameters. A gradient transformation
    that keeps the gradient's orientation (`optax.scale_by_adam()`, `optax.clip(1.0)`, `reduce_on_plateau`)
    becomes a stage of an optim chain with `gradient_like=True` (step = `+updates`), e.g.
    `optim.chain(optim.from_optax(optax.scale_by_adam(), gradient_like=True), optim.Descent(1e-3))`; without
    it, setup refuses it (its first update points along the gradient). `check=False` skips both checks.

    >>> import jax.numpy as jnp, optax, optim
    >>> from optim._optax import from_optax
    >>> w = jnp.array([1.0, 2.0])
    >>> state = optim.setup(from_optax(optax.sgd(0.1)), {"a": w, "b": w})
    >>> state, m = optim.update(state, {"a": w, "b": w}, {"a": jnp.ones(2), "b": jnp.ones(2)})
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
    if _is_transformation(tx):
        if hyperparameters:
            raise TypeError(f"from_optax: keyword arguments ({', '.join(hyperparameters)}) go with a factory such as "
                            f"optax.adam, not with an already built transformation ({_transformation_name(tx)})")
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
            raise TypeError(f"from_optax: {_label(tx)} does not take these arguments: {e}") from None
    cls = _factory_class(tuple((f, key) for f, key, _ in hyper))
    rule = cls(tx, extra or None, tree_args, tuple(sorted(static)), bool(check), bool(gradient_like),
               *[v for _, _, v in hyper])
    try:
        built = rule.transformation()
    except TypeError as e:
        raise TypeError(f"from_optax: calling {_label(tx)}(...) with these arguments failed: {e}") from e
    if not _is_transformation(built):
        raise TypeError(f"from_optax: {_label(tx)}(...) returned {type(built).__name__}, "
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
    >>> from optim._optax import from_optax, with_extra_args
    >>> tx = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    >>> state = optim.setup(from_optax(tx, extra_args={"value": 0.0}), {"w": jnp.ones(2)})
    >>> float(with_extra_args(state, value=3.5)["w"].rule.extra_args["value"])
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


# ------------------------------------------------------------------------------------------ to_optax
# `to_optax` lives in its own module, which uses the helpers above; imported here, where `optim` finds it.
from ._to_optax import to_optax  # noqa: E402
