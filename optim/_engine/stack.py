"""Stacks: the optimiser states of parameters with one rule, shape, dtype and placement, stored as one array
per state field with a leading axis over the parameters. How parameters are grouped (`make_stacks`), how a
stack's initial state is made where its parameters live (`init_stack`), and how rows are read and written
(`take_rows`, `put_rows`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, jaxprs_in_params

from .._base.cache import memoize
from .._base.tree import canonical_dtype, show
from .._rules.quantized import QuantizedArray
from .._rules.schedules import at_start


# Stacking rule (measured on XLA:CPU, Adam, `bench/NOTES.md`): for leaves of up to ~8k elements one kernel per
# group beats one per leaf (2.6x faster at 1.6k elements, even at 8k), and compiling is 3-4x faster; for larger
# leaves stacking costs an extra pass over memory (1.7x slower at 16k), so they stay alone. Groups are capped
# because XLA's compile time grows quadratically with the number of slices taken from one array.
STACK_MAX_SIZE = 8192


STACK_MAX_MEMBERS = 64
# In `make_stacks`' `wide`: `(ANY, r)` marks rule `r` as one whose large parameters are stacked whatever their dtype
# and placement (`Rule._stack_large`: SOAP batches its eigh / qr over a stack).
ANY = "any"
# In `make_stacks`' `wide`: `(GROUPED, r)` marks rule `r` as one whose large parameters XLA's path groups
# (`optim._engine.group`): stacked like the kernel's, at most `GROUP_MAX_ELEMENTS` elements a stack.
GROUPED = "grouped"
# In `make_stacks`' `wide`: `(ONE_KERNEL, r)` marks a grouped rule `r` whose group's step is one kernel of a
# strategy's own (optim._engine.multitensor): at most `ONE_KERNEL_MAX_ELEMENTS` elements a group.
ONE_KERNEL = "one kernel"
# In `make_stacks`' `wide`: `(SPLIT, r)` marks rule `r` as one whose large parameters are stacked where they live on
# a mesh of several devices (`Rule._split_large`: Muon splits a stack's Newton-Schulz across them).
SPLIT = "split"
# A group's elements at most: 16M (64 MB of float32): 100 of 400x400 are one group.
GROUP_MAX_ELEMENTS = 1 << 24
# ... and where its step is one kernel (`ONE_KERNEL`): 4M (16 MB of float32): 100 of 400x400 are four groups of
# 25. That kernel holds each member's step, and Triton's compile of it grows with the square of its members
# (bench/NOTES.md: 25 members compile in about a second, 64 in 6-8 s).
ONE_KERNEL_MAX_ELEMENTS = 1 << 22
# A grouped member's elements at most: 512k. On XLA's path a group's step moves 8 bytes a parameter more than one
# parameter's own step (Adam: 36 against 28, the floor: the new moments are written by one kernel and read back
# by the parameters' kernels) and saves about one kernel a member (~2.5 us of device time). Past ~1M float32
# elements the bytes cost more than the kernel (8 MB at an H100's ~3 TB/s); a GPT-2's matrices (590k to 2.4M)
# step alone, one pass each, as optax's (bench/NOTES.md, the deviceless bytes).
GROUP_MAX_MEMBER = 1 << 19
# The dtypes of parameters and state arrays that optim's fused CPU kernel reads (optim/_engine/fused.cc).
KERNEL_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def make_stacks(params: tuple, wide: frozenset = frozenset()) -> tuple[tuple[int, ...], ...]:
    """Partition parameter indices into stacks: same rule, shape, dtype, placement and requested state sharding
    (`setup(..., state_sharding=fn)`); small ones together (at most `STACK_MAX_MEMBERS`), large ones alone,
    except for the rules in `wide` (indices): the rules that optim's fused CPU kernel runs (`optim._engine.fused`),
    which reads each member where it is, so stacking their large parameters' states costs no pass (and saves
    the arrays in and out of each call), the rules `r` given as `(GROUPED, r)`, which XLA's path groups
    (`optim._engine.group`: at most `GROUP_MAX_ELEMENTS` elements a stack, `ONE_KERNEL_MAX_ELEMENTS` where
    `(ONE_KERNEL, r)` is given too), and the rules `r` given as
    `(ANY, r)`, which batch per-parameter matrix work over a stack (`Rule._stack_large`), and the rules `r` given
    as `(SPLIT, r)` where the parameter or its state lives on a mesh of several devices (`Rule._split_large`).
    Deterministic, in parameter order."""
    keys: list = []                  # each parameter's stacking key, None where it stays alone
    limits: dict = {}                # by key: a stack's members at most, and whether it steps in one kernel
    for p in params:
        size = math.prod(p.shape)
        grouped = (GROUPED, p.rule) in wide and size <= GROUP_MAX_MEMBER
        split = (SPLIT, p.rule) in wide and _several(p.place, p.state_place)
        if size > STACK_MAX_SIZE and (ANY, p.rule) not in wide and not split and not (
                (p.rule in wide or grouped) and p.place is None and p.state_place is None
                and p.dtype in KERNEL_FLOATS):
            keys.append(None)
            continue
        key = (p.rule, p.shape, p.dtype, p.place, p.state_place)
        keys.append(key)
        one_kernel = grouped and size > STACK_MAX_SIZE and (ONE_KERNEL, p.rule) in wide
        elements = ONE_KERNEL_MAX_ELEMENTS if one_kernel else GROUP_MAX_ELEMENTS
        full = elements // size if grouped and size > STACK_MAX_SIZE else STACK_MAX_MEMBERS
        limits[key] = (max(1, min(STACK_MAX_MEMBERS, full)), one_kernel)
    # Groups stepped in one kernel are as equal as their count allows (100 under a cap of 26 are four groups of 25,
    # not three of 26 and one of 22): groups of one shape share their kernel, which is then built once.
    most = {}
    for key, n in collections.Counter(k for k in keys if k is not None).items():
        cap, one_kernel = limits[key]
        most[key] = math.ceil(n / math.ceil(n / cap)) if one_kernel else cap
    by_key: dict = {}
    out: list[list[int]] = []
    for u, key in enumerate(keys):
        if key is None:
            out.append([u])
            continue
        g = by_key.get(key)
        if g is None or len(g) >= most[key]:
            g = by_key[key] = []
            out.append(g)
        g.append(u)
    return tuple(tuple(g) for g in out)


def _several(*shardings: Any) -> bool:
    """Whether one of `shardings` is a `NamedSharding` over several devices."""
    return any(isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1 for s in shardings)


def init_stack(rule: Any, xs: list, where: Callable[[], str], cache: dict | None = None,
               local: bool | None = None, sharding: Any = None) -> Any:
    """The initial state of one stack: `rule.init` of each of `xs`, stacked on a new leading axis.

    An init that does not read the parameter's values (zeros, constants: every built-in rule but
    MixedPrecision) runs once per (rule, shape, dtype); the stack's state is then a read-only host (numpy)
    broadcast of it, which the first `update` moves to the device inside jit's argument handling. Creating
    device arrays costs ~60 us of Python each; this keeps `setup` at about a microsecond per parameter.
    Parameters that are not numpy or single-device arrays (sharded, traced) get a jitted, vmapped init that
    creates the state where the parameters live. `local` says whether all of `xs` are host or default-device
    arrays, when the caller knows (it costs a few microseconds per array to find out).

    `sharding` (from `setup(..., state_sharding=fn)`) is the sharding requested for one parameter's state
    arrays: the stack's arrays of the parameters' shape get it with an unsharded leading member axis, the others
    are replicated over the same devices (`stack_shardings`). A host-made initial state is then put there with
    `jax.device_put` (no compiling); an init that reads the parameters runs jitted into those shardings.
    """
    key, rule = id(rule), at_start(rule)     # the init reads its schedules' values at step 0
    try:
        if sharding is not None:
            proto = _host_init(rule, tuple(xs[0].shape), canonical_dtype(xs[0].dtype), cache, key)
            if proto is not None:
                return place_stack(stack_states([proto] * len(xs)), sharding, tuple(xs[0].shape))
            return _placed_init(rule, xs, sharding)
        if local if local is not None else all(_local(x) for x in xs):
            proto = _host_init(rule, tuple(xs[0].shape), canonical_dtype(xs[0].dtype), cache, key)
            if proto is not None:
                return stack_states([proto] * len(xs))
        return _placed_init(rule, xs)
    except (TypeError, ValueError) as e:
        raise _at(e, f"setup: at {show(where())}: {e}") from e


def _at(e: Exception, message: str) -> Exception:
    """`e`'s kind of error with `message` (naming the path). Errors whose constructor takes something else
    than a message (JAX's tracer errors take the tracer) become a plain `TypeError` / `ValueError`."""
    if type(e) in (TypeError, ValueError):
        return type(e)(message)
    try:
        out = type(e)(message)
    except Exception:  # noqa: BLE001 (any constructor that does not take a message)
        return (TypeError if isinstance(e, TypeError) else ValueError)(message)
    return out if str(out) == message else (TypeError if isinstance(e, TypeError) else ValueError)(message)


def _host_init(rule: Any, shape: tuple, dtype: np.dtype, cache: dict | None, rule_id: int) -> Any:
    """`rule.init` of a parameter of this shape and dtype as read-only numpy arrays, or None when the init
    reads the parameter's values. `cache` (one per `setup` call, keyed by `rule_id`, the `id` of the rule object
    `setup` holds: `rule` may be a copy with its schedules at step 0) saves the tracing.

    Traced, not run: an array filled with one value (zeros, a constant) becomes a zero-stride view of that value,
    which holds no memory until the first `update` moves it to the device (optax's `init` allocates its zeros
    once; running `rule.init` here allocated them twice more, on the device and as the host copy)."""
    key = (rule_id, shape, dtype)
    if cache is not None and key in cache:
        return cache[key]
    x = jax.ShapeDtypeStruct(shape, dtype)
    closed, shapes = jax.make_jaxpr(rule.init, return_shape=True)(x)
    out = None
    if _reads_nothing(closed.jaxpr):
        # Evaluated now, also when `setup` runs inside a traced function on a concrete (closed-over) model:
        # these values depend on nothing traced, so they are constants, not tracers of the outer trace.
        with jax.ensure_compile_time_eval():
            host = _host_values(closed)
            if host is None:     # not a plain sequence of primitives: run the init (it allocates its outputs)
                host = [np.array(a) for a in jax.tree.leaves(rule.init(jnp.zeros(shape, dtype)))]
        for h in host:
            h.flags.writeable = False
        out = jax.tree.structure(shapes).unflatten(host)
    if cache is not None:
        cache[key] = out
    return out


def _host_values(closed: Any) -> list | None:
    """The outputs of a jaxpr that reads no input, as numpy arrays: a scalar broadcast (`jnp.zeros`,
    `jnp.full`) as a zero-stride view of the scalar, the rest computed. None if an equation holds a jaxpr of its
    own (a nested jit or custom derivative: the caller runs the function instead)."""
    jaxpr = closed.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed.consts))
    views: set = set()      # ids of the zero-stride views made here (anything else is copied)

    def read(a):
        return a.val if isinstance(a, Literal) else env[a]

    for e in jaxpr.eqns:
        if any(True for _ in jaxprs_in_params(e.params)):
            return None
        ins = [read(a) for a in e.invars]
        if e.primitive.name == "broadcast_in_dim" and np.ndim(ins[0]) == 0:
            aval = e.outvars[0].aval
            env[e.outvars[0]] = view = np.broadcast_to(np.asarray(ins[0], aval.dtype), aval.shape)
            views.add(id(view))
            continue
        outs = e.primitive.bind(*ins, **e.params)
        for v, o in zip(e.outvars, outs if e.primitive.multiple_results else [outs]):
            env[v] = o
    return [read(v) if id(read(v)) in views else np.array(read(v), v.aval.dtype) for v in jaxpr.outvars]


def stack_states(states: list) -> Any:
    """Stack per-parameter states (one structure) on a new leading axis. Host arrays stay on the host; the
    same host array repeated (a shared initial state) becomes a read-only broadcast, which costs nothing."""
    leaves0, treedef = jax.tree_util.tree_flatten(states[0])
    if all(isinstance(a, np.ndarray) for a in leaves0) and all(s is states[0] for s in states):
        return treedef.unflatten([np.broadcast_to(a, (len(states),) + a.shape) for a in leaves0])
    columns = zip(*[jax.tree_util.tree_flatten(s)[0] for s in states]) if len(states) > 1 else [[a] for a in leaves0]
    out = []
    for col in columns:
        col = list(col)
        if all(isinstance(a, np.ndarray) for a in col):
            if all(a is col[0] for a in col):
                out.append(np.broadcast_to(col[0], (len(col),) + col[0].shape))
            else:
                out.append(np.stack(col))
        else:
            out.append(stack_arrays(col))
    return treedef.unflatten(out)


def stack_arrays(xs: list) -> jax.Array:
    """Arrays stacked on a new leading axis (a stack of one is a free reshape)."""
    if len(xs) == 1:
        return jnp.expand_dims(jnp.asarray(xs[0]), 0)
    return jnp.stack([jnp.asarray(x) for x in xs])


def _placed_init(rule: Any, xs: list, sharding: Any = None) -> Any:
    """The state of a stack placed like `xs[0]` from the vmapped `rule.init`, creating every state
    array where it will be used: arrays with the stacked parameters' shape get their sharding (FSDP / ZeRO:
    each device holds the state of its own shard), the rest (Adam's beta powers) are replicated over the same
    devices. Jitted, so a sharded parameter's state is never materialised whole on one device, and the
    parameters are stacked only for an init that reads them. An init that cannot be traced (it reads concrete
    values) runs per parameter, eagerly (and is then put where `sharding` says, when given). `sharding`: the
    requested sharding of one parameter's state (`setup(..., state_sharding=fn)`), in place of `xs[0]`'s."""
    batched = jax.vmap(rule.init)
    x = xs[0]
    requested = sharding
    if sharding is None:
        sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and not getattr(x, "_committed", True):
            # An uncommitted parameter (made by jnp on the default device) gets an uncommitted state: a
            # committed one would commit the step's outputs, model included, and the user's jitted step would
            # compile again on its second call, for committed inputs.
            sharding = None
    places = stack_shardings(sharding)
    if places is None:
        return batched(stack_arrays(xs))
    stacked, rep = places
    shape = (len(xs),) + tuple(x.shape)
    abstract = jax.ShapeDtypeStruct(shape, x.dtype)
    try:
        shapes = jax.eval_shape(batched, abstract)
    except Exception:   # e.g. converts x to numpy: not traceable
        return place_stack(stack_states([rule.init(a) for a in xs]), requested, tuple(x.shape))
    place = jax.tree.map(lambda s: stacked if s.shape == shape else rep, shapes)
    if reads_nothing(batched, abstract):
        return jax.jit(lambda: batched(jnp.zeros(shape, x.dtype)), out_shardings=place)()
    return jax.jit(batched, out_shardings=place)(stack_arrays(xs))


def stack_shardings(sharding: Any) -> tuple[Any, Any] | None:
    """For one parameter's state `sharding`: (the sharding of a stack's arrays of the parameters' shape, that of
    its other arrays). A `NamedSharding` P(*spec) gives P(None, *spec): the stack is sharded on the parameter's
    axes, never on its member axis (whose length depends on optim's grouping), and the other arrays (Adam's β
    powers, factored statistics, counters) are replicated over the same mesh. A single device holds both. None
    for anything else."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        P = jax.sharding.PartitionSpec   # noqa: N806
        mesh, kind = sharding.mesh, sharding.memory_kind
        return (jax.sharding.NamedSharding(mesh, P(None, *sharding.spec), memory_kind=kind),
                jax.sharding.NamedSharding(mesh, P(), memory_kind=kind))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding, sharding
    return None


def place_stack(tree: Any, sharding: Any, shape: tuple) -> Any:
    """A stack's state arrays put where `stack_shardings(sharding)` says (no-op for None, for traced arrays and
    for arrays already there). `shape`: one parameter's shape."""
    places = None if sharding is None else stack_shardings(sharding)
    if places is None:
        return tree

    def put(a: Any, want: Any) -> Any:
        if isinstance(a, jax.core.Tracer) or not hasattr(a, "shape"):
            return a
        if isinstance(a, jax.Array) and (a.sharding is want or a.sharding.is_equivalent_to(want, a.ndim)):
            return a
        return jax.device_put(a, want)

    return _map_placed(put, tree, sharding, places, shape)


def _map_placed(f: Any, tree: Any, sharding: Any, places: tuple, shape: tuple) -> Any:
    """`f(array, its sharding)` over a stack's state tree: arrays of the parameters' shape get the stacked
    sharding, a quantised moment's codes and scales `quantized_shardings`, the rest the replicated one."""
    stacked, rep = places

    def one(a: Any) -> Any:
        if isinstance(a, QuantizedArray):
            codes, scale = quantized_shardings(sharding, shape, a.fmt.block) or (rep, rep)
            return dataclasses.replace(a, codes=f(a.codes, codes), scale=f(a.scale, scale))
        return f(a, stacked if hasattr(a, "shape") and tuple(a.shape[1:]) == shape and a.ndim == len(shape) + 1
                 else rep)

    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, QuantizedArray))


def quantized_shardings(sharding: Any, shape: tuple, block: int) -> tuple | None:
    """The shardings of a stack's quantised moment's codes and scales (`optim._rules.quantized`) for a
    parameter whose state `sharding` splits only its first axis, into parts of whole blocks: the codes' and
    scales' block axis split the same way, so each device reads and writes the blocks of its own rows (ZeRO-1
    keeps its memory saving and needs no communication). None (replicated) for any other sharding: correct,
    but every device holds the whole moment."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not shape:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    if spec[0] is None or any(d is not None for d in spec[1:]):
        return None
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    parts = math.prod(sharding.mesh.shape[n] for n in names)
    if shape[0] % parts or (math.prod(shape) // parts) % block:
        return None
    P = jax.sharding.PartitionSpec   # noqa: N806
    kind = sharding.memory_kind
    return (jax.sharding.NamedSharding(sharding.mesh, P(None, spec[0], None), memory_kind=kind),
            jax.sharding.NamedSharding(sharding.mesh, P(None, spec[0]), memory_kind=kind))


def constrain_stack(tree: Any, sharding: Any, shape: tuple) -> Any:
    """Inside a traced step: a stack's new state arrays constrained to `stack_shardings(sharding)`, so XLA keeps
    the requested state sharding however it propagates the arithmetic (see `constrain`)."""
    places = None if sharding is None else stack_shardings(sharding)
    if places is None or not isinstance(sharding, jax.sharding.NamedSharding):
        return tree
    return _map_placed(constrain, tree, sharding, places, shape)


def constrain(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` constrained to a `NamedSharding` inside a traced function: `jax.sharding.reshard` on a mesh with
    `Explicit` axes (where the sharding is part of the array's type, and `with_sharding_constraint` refuses
    them), else `jax.lax.with_sharding_constraint`. Anything but a NamedSharding: `x` unchanged."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    named = [a for d in sharding.spec if d is not None for a in (d if isinstance(d, tuple) else (d,))]
    explicit = jax.sharding.AxisType.Explicit
    if any(types[a] == explicit for a in named) or (not named and explicit in types.values()):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _local(x: Any) -> bool:
    """A numpy array, or a concrete jax array on the default device."""
    if isinstance(x, np.ndarray):
        return True
    sharding = getattr(x, "sharding", None)
    if sharding is _LAST_LOCAL[0]:          # arrays made alike share their sharding object: skip the comparison
        return True
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding) or isinstance(x, jax.core.Tracer):
        return False
    if sharding == _default_sharding():
        _LAST_LOCAL[0] = sharding
        return True
    return False


_LAST_LOCAL: list = [None]


def placement(x: Any) -> Any:
    """What `Param.place` records: None for numpy and default-device arrays, else the array's sharding."""
    if _local(x) or isinstance(x, jax.core.Tracer):
        return None
    return getattr(x, "sharding", None)


@memoize(1)     # 1: it takes no arguments
def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def reads_nothing(fn: Callable, x: Any) -> bool:
    """Whether `fn(x)`'s outputs depend only on x's shape and dtype, not its values (`x` may be a
    `jax.ShapeDtypeStruct`: traced, nothing is allocated)."""
    return _reads_nothing(jax.make_jaxpr(fn)(x).jaxpr)


def _reads_nothing(jaxpr: Any) -> bool:
    v = jaxpr.invars[0]
    return not any(a is v for e in jaxpr.eqns for a in e.invars) and not any(a is v for a in jaxpr.outvars)



def row_index(rows: tuple[int, ...]) -> Any:
    """An index for the given rows of a stack: a slice when they are contiguous (no gather), else a numpy array
    (which indexes host and device stacks alike)."""
    rows = tuple(rows)
    if rows == tuple(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return np.asarray(rows, np.int32)


def take_rows(tree: Any, rows: tuple[int, ...], n: int) -> Any:
    """The given rows of every array of a stacked state (all of it when every row steps)."""
    if len(rows) == n:
        return tree
    ix = row_index(rows)
    return jax.tree.map(lambda a: a[ix], tree)


def put_rows(tree: Any, rows: tuple[int, ...], new: Any, n: int) -> Any:
    if len(rows) == n:
        return new
    ix = row_index(rows)
    return jax.tree.map(lambda a, b: jnp.asarray(a).at[ix].set(b), tree, new)


def traced_sharded(a: Any) -> bool:
    """Whether `a`'s abstract value carries a sharding over a mesh (explicit sharding, `shard_map`): such
    computations keep the plain per-stack path (`optim._engine.hoist`) and XLA's code (`optim._engine.fused`)."""
    s = getattr(jax.typeof(a), "sharding", None)
    return s is not None and not s.mesh.empty
