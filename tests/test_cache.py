"""optim's caches: every module-level cache is a bounded LRU (`optim/_core/cache.py`); the eager program cache of
`update` in particular, where evicting a program frees what was compiled for it.

Each distinct `None` pattern in the gradients is a new program. Every program-cache test runs on a fresh, small
cache.
"""

import contextlib
import importlib
import gc
import itertools
import os
import pathlib
import re
import weakref

import jax
import jax.numpy as jnp
import pytest

import optim
import optim._core.program as plans
from optim._base.cache import LRU, memoize

L = 6   # leaves; each nonempty subset is a `None` pattern (63 of them)


@pytest.fixture
def small_cache(monkeypatch):
    def limit(n):
        monkeypatch.setattr(plans, "_PROGRAMS", LRU(n))
    return limit


def setup():
    model = {f"l{i}": jnp.full((2,), float(i)) for i in range(L)}
    return optim.setup(optim.Descent(0.1), model), model


def patterns(n, skip_full=False):
    """`n` gradient trees, each with a different set of leaves set to None."""
    g = jnp.ones((2,))
    subsets = [c for r in range(L, 0, -1) for c in itertools.combinations(range(L), r)][int(skip_full):]
    return [{f"l{i}": g if i in c else None for i in range(L)} for c in subsets[:n]]


@contextlib.contextmanager
def counting_compiles():
    """Counts XLA compilations (old and new cache alike compile through jit)."""
    seen = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_lru_keeps_the_pattern_used_on_every_step(small_cache, monkeypatch):
    small_cache(4)
    built = []
    program = plans._make
    monkeypatch.setattr(plans, "_make", lambda *a: built.append(program(*a)) or built[-1])
    state, model = setup()
    hot, *rare = patterns(13)
    for _ in range(2):   # the second call sees committed arrays (a new signature for jit), then stays warm
        state, model = optim.update(state, model, hot)
    with counting_compiles() as compiles:
        for g in rare:   # 12 rare patterns through a cache of 4, the hot one in between
            state, model = optim.update(state, model, g)
            state, model = optim.update(state, model, hot)
    jax.block_until_ready(model)
    assert len(built) == 1 + len(rare), "the pattern used on every step was evicted and rebuilt"
    assert len(compiles) == len(rare), "the pattern used on every step was compiled again"
    assert built[0] in plans._PROGRAMS.values() and len(plans._PROGRAMS) == 4
    assert next(reversed(plans._PROGRAMS.values())) is built[0]   # most recently used last


def test_eviction_frees_the_program_and_its_executables(small_cache):
    small_cache(2)
    state, model = setup()
    first, *others = patterns(13)
    # all three callables of a program: plain, donated, and the one behind tie_grads
    state, model = optim.update(state, model, first)
    state, model = optim.update(state, jax.tree.map(jnp.copy, model), first, donate=True)
    optim.tie_grads(state, first)
    dead = weakref.ref(next(reversed(plans._PROGRAMS.values())))
    client = jax.devices()[0].client
    live = getattr(client, "live_executables", None)
    gc.collect()
    before = len(live()) if live else 0
    for g in others:
        state, model = optim.update(state, model, g)
    jax.block_until_ready(model)
    gc.collect()
    assert dead() is None, "an evicted Program is still alive (and with it its executables)"
    assert sum(isinstance(o, plans.Program) and o.layout is state.layout for o in gc.get_objects()) <= 2
    if live:
        # `first` had 3 executables (now freed); 2 programs of one executable each are cached
        assert len(live()) - before <= 2, f"{len(live()) - before} more live executables after 12 evictions"
    # an evicted pattern comes back as a new program, and still works, donated too
    state, new = optim.update(state, jax.tree.map(jnp.copy, model), first, donate=True)
    assert jnp.allclose(new["l0"], model["l0"] - 0.1)


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_rss_stays_flat_when_patterns_cycle_through_a_small_cache(small_cache):
    small_cache(4)
    state, model = setup()
    gs = patterns(30)
    growth = []
    for _ in range(3):   # each cycle compiles all 30 again (LRU cannot help a cycle longer than the cache)
        gc.collect()
        r = rss_mib()
        for g in gs:
            state, model = optim.update(state, model, g)
        jax.block_until_ready(model)
        gc.collect()
        growth.append(rss_mib() - r)
    print("RSS growth per cycle (MiB):", growth)
    # The old cache kept every executable alive, ~1.6 MiB each here, so each cycle grew by ~50 MiB.
    assert growth[2] < max(0.25 * growth[0], 8.0), f"RSS growth per cycle (MiB): {growth}"


# ------------------------------------------------------------------------------------------- every cache
def module_caches() -> dict[str, LRU]:
    """Every module-level cache of optim: `LRU`s, and the `LRU` behind each `memoize`d function."""
    out = {}
    root = pathlib.Path(optim.__file__).parent
    for path in sorted(root.rglob("*.py")):   # not the compiled kernel (a .so)
        dotted = ".".join(path.relative_to(root).with_suffix("").parts)
        mod = importlib.import_module(f"optim.{dotted}")
        for name, v in vars(mod).items():
            if isinstance(v, LRU):
                out[f"{dotted}.{name}"] = v
            elif isinstance(getattr(v, "cache", None), LRU) and v.__module__ == mod.__name__:
                out[f"{dotted}.{name}"] = v.cache
    return out


def test_every_module_cache_is_a_bounded_lru():
    sizes = {name: c.maxsize for name, c in module_caches().items()}
    assert sizes == {
        "_core.program._PROGRAMS": 256, "_io.checkpoint_format._SIGNATURES": 1024,
        "_io.checkpoint_format._DTYPES": 64, "_io.checkpoint_format._DTYPE_NAMES": 64,
        "_interop.optax_checks._CHECKED": 1024, "_interop.optax._factory_class": 1024,
        "_engine.stack._default_sharding": 1, "_io.state_dict._stacker": 256, "_core.average._averager": 32,
        "_base.tree._INEXACT": 64, "_engine.hoist._SPLITS": 1024, "_core.state._SHAPES": 4096,
        "_core.setup._WARNED_TRACED": 64, "_engine.group._READS": 256, "_rules.fields.small_fields": 1024,
        "_engine.multitensor._jitted_pallas": 64}
    # no cache outside the policy: functools' unbounded caches, or dicts cleared when full
    src = "".join(p.read_text() for p in pathlib.Path(optim.__file__).parent.rglob("*.py") if p.name != "cache.py")
    assert not re.findall(r"functools\.cache\b|lru_cache\(|OrderedDict\(|\.clear\(\)", src)


def test_lru_evicts_the_least_recently_used():
    c = LRU(3)
    for k in "abc":
        c[k] = k.upper()
    assert c.get("a") == "A"          # a use: "b" is now the least recently used
    c["d"] = "D"
    assert len(c) == 3 and "b" not in c and c.values() == ["C", "A", "D"]
    assert c.get("a") == "A" and c.get("a") == "A" and c.values() == ["C", "D", "A"]   # a repeated hit stays last
    c["c"] = "C2"                     # a store replaces and uses
    assert c.values() == ["D", "A", "C2"] and c.get("b", 0) == 0
    with pytest.raises(TypeError):
        c.get([1])                    # unhashable keys raise, as in a dict
    with pytest.raises(ValueError, match="maxsize must be at least 1"):
        LRU(0)


def test_memoize_is_bounded():
    calls = []

    @memoize(2)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(x) for x in (1, 2, 1, 3, 1, 2)] == [1, 4, 1, 9, 1, 4]
    assert calls == [1, 2, 3, 2] and len(square.cache) == 2     # 2 was evicted by 3, 1 kept by its uses


def test_signature_cache_evicts(monkeypatch):
    from optim._io import checkpoint_format as F
    monkeypatch.setattr(F, "_SIGNATURES", LRU(2))
    trees = [jax.tree.structure(t) for t in ({"a": 1}, [1, 2], (1, {"b": 2}))]
    for td in trees:
        F.signature(td)
    assert len(F._SIGNATURES) == 2 and trees[0] not in F._SIGNATURES and trees[2] in F._SIGNATURES


def test_state_init_shapes_cache_evicts(monkeypatch):
    import optim._core.state as S
    monkeypatch.setattr(S, "_SHAPES", LRU(2))
    model = {"a": jnp.ones(2), "b": jnp.ones((2, 3)), "c": jnp.ones((4,), jnp.bfloat16)}
    state = optim.setup(optim.Adam(0.1), model)
    for path in model:
        assert [x.shape for x in state[path].state[:2]] == [model[path].shape] * 2     # mu, nu
    assert len(S._SHAPES) == 2
