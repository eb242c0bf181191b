"""The registry of rule cases: one `RuleCases` entry per rule class (every rule class `optim.__all__` exports),
everything the per-rule tests need to know about it, in one place. `test_rules.py`, `test_stacking.py`,
`test_parity.py`, `test_fused.py` and `zero1_cases.py` derive their tables from `RULES` (`CASES`, `CONVERGENCE`,
`BAD_HYPER`, `PARITY`, the kernel's `RULES`, `every_rule()`, ...: see `table` at the end); `test_tables.py` checks
that every exported rule class has an entry and that each entry has an optax case or says why not.

Adding a rule is one more entry here (and its numpy reference `r_*` in `rule_refs.py`; CONTRIBUTING.md has the
checklist): no test file lists rules by hand. Fill in the fields that apply; at least `zero1` (every rule) and
`optax` / `x64_optax` or `no_optax`, and `kernel` if the class declares a formula the fused kernel computes.

An entry holds the rule's class-level facts (its defaults, whether its first argument is a learning rate,
whether its step depends on the whole parameter) and its configurations, each with the id its tests carry:

- `references`: `Reference(id, make, ref, nsteps)`, a float64 numpy reference (`rule_refs.py`) that
  `test_rules.py::test_rule_matches_reference` follows for `nsteps` steps (rtol 1e-5, the displacement 2e-4),
  and that `test_stacking.py::test_stacked_update_equals_per_leaf_rule` runs stacked (with `stacked`). A
  reference case runs on scalars, vectors and matrices.
- `stacked`: `Case(id, make)`, more configurations for the stacking test only.
- `matrices`: `Case(id, make)`, the configurations of a rule for matrices only (Muon, NorMuon: vectors and
  scalars are refused), that `test_stacking.py::test_matrix_rule_stacked_equals_per_leaf` runs stacked on a
  model of matrices (`None` gradients, a frozen member).
- `converges`: `Converges(id, make, threshold)` for R1 (`test_rule_converges_on_a_linear_regression`).
- `dtypes` (F6: float16, bfloat16 and float32 parameters keep their dtype), `bfloat16` (steps track float32's),
  `complex_` (R5: a complex loss decreases): `Case(id, make)`.
- `keywords`: `(keyword constructor, positional constructor)` pairs that must be equal (F9).
- `int_hyperparameters`: `IntHyper(id, make, field)`: an integer given, a float stored.
- `bad`: `Bad(id, make, err, match)`: hyperparameters refused at construction; `structural`: the same for
  structural arguments.
- `state_dtypes`: `StateDtypes(id, make(**dtypes), roles)`: `mu_dtype` / `nu_dtype` and the role of each state
  leaf ("mu", "nu" or None).
- `x64_optax`: `Optax(id, make, make_tx, defaults)`: 30 steps against optax in float64 on a tied model (rtol
  1e-10; `test_rules.py`); `defaults` marks the configuration with the rule's own defaults.
- `optax`: `Parity(id, make, make_tx, init=None, rtol=1e-6, atol=1e-12)`: 100 steps against optax in float64
  on an untied model (`test_parity.py`); optax configured, or composed from its primitives, to optim's
  conventions; `init` rewrites optax's fresh state (AMSGrad's moments start at ε).
- `optax_differs`: `Differs(id, make, make_tx, reason)`: where optax's defaults follow another convention,
  `reason` says which, and `test_parity.py` checks that the two do differ.
- `no_optax`: why the registry has no `optax` or `x64_optax` case for the rule: optax has no counterpart, or
  another test file compares it (named in the reason). An entry has optax cases or this reason, not both.
- `zero1`: `Case(id, make)`: the configurations `zero1_cases.every_rule()` trains with a ZeRO-1 sharded state
  (`id` is the model's top-level key: a valid name, unique over the registry); a stateless stage runs in a chain.
- `kernel`: `Kernel(id, make, state_ulps=4)`: the configurations `test_fused.py` runs through the fused CPU
  kernel against XLA's path (ids unique over the registry): the rules whose class declares a kernel formula,
  and the wrappers and chains the kernel runs them in (in the outermost wrapper's entry).
- `adjust`: `(make, [changes, ...])`: adjusting those hyperparameters never retraces.

Properties of the rule: `reduces_over_parameter` (its step depends on the whole parameter, a norm or a matrix
product: a batched reduction may sum in another order, so stacking is compared within 8 ulp, not 2; a chain or
wrapper reduces when a rule inside it does, see `reduces`), `trust_ratio` (Lamb, Lars: a ratio of norms, 1 where
a norm is 0), `evaluates_at_average` (the model is evaluated at `optim.averaged`, ScheduleFreeAdamW).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optim
from optim._rules.protocol import inner_fields
from rule_refs import (
    r_adabelief, r_adadelta, r_adagrad, r_adam, r_adamax, r_adamw, r_ademamix, r_adopt, r_amsgrad, r_cautious,
    r_chain, r_clipgrad, r_clipnorm, r_descent, r_lion, r_momentum, r_nadam, r_nesterov, r_oadam, r_radam, r_rmsprop,
    r_rprop, r_signdecay, r_weightdecay, f32, r_prodigy, r_dog, r_shampoo, r_mars, r_kron,
)

O = optim


class Reference(NamedTuple):
    id: str
    make: Callable
    ref: Any
    nsteps: int


class Case(NamedTuple):
    id: str
    make: Callable


class Converges(NamedTuple):
    id: str
    make: Callable
    threshold: float


class IntHyper(NamedTuple):
    id: str
    make: Callable
    field: str


class Bad(NamedTuple):
    id: str
    make: Callable
    err: type
    match: str


class StateDtypes(NamedTuple):
    id: str
    make: Callable
    roles: tuple


class Optax(NamedTuple):
    id: str
    make: Callable
    make_tx: Callable
    defaults: bool = False


class Parity(NamedTuple):
    """100 steps against optax in float64 (`test_parity.py`): the parameters to `rtol`, the displacement from the
    start to `rtol` and `atol`."""
    id: str
    make: Callable
    make_tx: Callable
    init: Callable | None = None     # applied to optax's fresh state (AMSGrad's moments start at ε)
    rtol: float = 1e-6
    atol: float = 1e-12


class Differs(NamedTuple):
    """A documented difference of convention: with its defaults optax does not give optim's numbers (10 steps)."""
    id: str
    make: Callable
    make_tx: Callable
    reason: str


class Kernel(NamedTuple):
    """A configuration the fused CPU kernel runs (`test_fused.py`): equal to XLA's path within 4 ulp of each
    array's scale, the state within `state_ulps`."""
    id: str
    make: Callable
    state_ulps: int = 4


@dataclasses.dataclass(frozen=True)
class RuleCases:
    """Everything the property tests know about one rule class (see the module docstring)."""
    cls: type
    default: Any = None                 # what `cls()` equals, with every default spelled out; None: not checked
    has_lr: bool = False                # the first argument is a learning rate (>= 0)
    reduces_over_parameter: bool = False
    trust_ratio: bool = False
    evaluates_at_average: bool = False
    references: tuple = ()
    stacked: tuple = ()
    matrices: tuple = ()
    converges: tuple = ()
    dtypes: tuple = ()
    bfloat16: tuple = ()
    complex_: tuple = ()
    keywords: tuple = ()
    int_hyperparameters: tuple = ()
    bad: tuple = ()
    structural: tuple = ()
    state_dtypes: tuple = ()
    x64_optax: tuple = ()
    optax: tuple = ()
    optax_differs: tuple = ()
    no_optax: str = ""                  # why the registry has no optax case for the rule (see the module docstring)
    zero1: tuple = ()
    kernel: tuple = ()
    adjust: tuple = ()


def _sf_adamw_warmup64(lr, warmup_steps, b1, b2, eps, weight_decay, weight_lr_power):
    """`optax.contrib.schedule_free_adamw` as optax composes it, with its warmup schedule computed in float64:
    optax's `warmup_constant_schedule` divides an int32 count and returns float32 even under x64 (a relative
    error of ~1e-8 in every warmup step; `test_schedule_free_warmup_matches_optax_alias` compares with it)."""
    def sched(count):
        return lr * jnp.minimum(count, warmup_steps).astype(jnp.float64) / warmup_steps

    base = optax.chain(optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
                       optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(sched))
    return optax.contrib.schedule_free(base, sched, b1=b1, weight_lr_power=weight_lr_power)


_TIGHT = dict(rtol=1e-10, atol=1e-14)     # optax.contrib's ADOPT and AdEMAMix follow optim's conventions exactly


def fill_eps(eps):
    """optax's AMSGrad state with m, v, v̂ starting at ε, as Optimisers.jl's."""
    def init(state):
        def fill(s):
            if isinstance(s, optax.ScaleByAmsgradState):
                full = lambda t: jax.tree.map(lambda x: jnp.full_like(x, eps), t)      # noqa: E731
                return s._replace(mu=full(s.mu), nu=full(s.nu), nu_max=full(s.nu_max))
            return s
        return jax.tree.map(fill, state, is_leaf=lambda s: isinstance(s, optax.ScaleByAmsgradState))
    return init


def _linear64(start, end, steps):
    """optim's `Linear(start, end, steps)` for optax in float64 (optax's own `linear_schedule` returns float32 under
    x64, ~1e-7 relative)."""
    return lambda c: start + (end - start) * jnp.minimum(c, steps).astype(jnp.float64) / steps


class PaperBeta3(O.Schedule):
    """AdEMAMix's β₃ warmup from the paper (Pagliardini et al. 2024, arXiv:2409.03050, section 3 and Algorithm 1):
    `min(exp(ln β_start ln β₃ / ((1 - t/T) ln β₃ + (t/T) ln β_start)), β₃)`, β_start at t = 0, β₃ from t = T:
    a schedule of one's own, as the AdEMAMix docstring suggests (optim has no built-in one)."""

    start: float
    end: float
    steps: float
    _values = ("start", "end")
    _divisors = ("steps",)

    def __call__(self, step):
        frac = jnp.minimum(jnp.asarray(step, jnp.float64), self.steps) / self.steps
        a, b = jnp.log(self.start), jnp.log(self.end)
        return jnp.minimum(jnp.exp(a * b / ((1 - frac) * b + frac * a)), self.end)


# The measured final losses of `converges` (jax 0.10.2, CPU) are noted after each; see `test_rules.py` section 3.
RULES = [
    RuleCases(
        O.Descent, O.Descent(0.1), has_lr=True,
        references=(Reference("Descent()", lambda: O.Descent(), r_descent(0.1), 5),
                    Reference("Descent(lr=.05)", lambda: O.Descent(lr=0.05), r_descent(0.05), 5)),
        converges=(Converges("Descent()", lambda: O.Descent(), 0.01),),                       # 3.4e-3
        dtypes=(Case("Descent", lambda: O.Descent()),),
        complex_=(Case("Descent", lambda: O.Descent(1e-2)),),
        keywords=((lambda: O.Descent(lr=0.2), lambda: O.Descent(0.2)),),
        int_hyperparameters=(IntHyper("Descent(1)", lambda: O.Descent(1), "lr"),
                             IntHyper("Descent(jnp.asarray(1))", lambda: O.Descent(jnp.asarray(1)), "lr")),
        bad=(Bad("lr nan", lambda: O.Descent(float("nan")), ValueError,
                 "Descent: lr must be >= 0 and finite, got nan"),
             Bad("lr jax negative", lambda: O.Descent(jnp.asarray(-1.0)), ValueError, "Descent: lr must be >= 0"),
             Bad("lr bool", lambda: O.Descent(True), TypeError, "Descent: lr must be a real number"),
             Bad("lr complex", lambda: O.Descent(1j), TypeError, "Descent: lr must be a real number"),
             Bad("lr schedule in a Join", lambda: O.Descent(O.Join((O.Constant(0.1), O.Cosine(0.1, 10, -0.01)),
                                                                    (5,))), ValueError,
                 r"Descent: lr must be >= 0 at every step, but the schedule Join\(.*\) takes values down to -0.01")),
        optax=(Parity("Descent", lambda: O.Descent(0.1), lambda: optax.sgd(0.1)),),
        zero1=(Case("Descent", lambda: O.Descent(0.1)),),
        kernel=(Kernel("Descent", lambda: O.Descent(0.1)),),
    ),
    RuleCases(
        O.Momentum, O.Momentum(0.01, 0.9), has_lr=True,
        references=(Reference("Momentum()", lambda: O.Momentum(), r_momentum(0.01, 0.9), 5),
                    Reference("Momentum(.1,.8)", lambda: O.Momentum(lr=0.1, rho=0.8), r_momentum(0.1, 0.8), 5)),
        converges=(Converges("Momentum()", lambda: O.Momentum(), 0.01),),                     # 3.2e-3
        dtypes=(Case("Momentum", lambda: O.Momentum()),),
        bfloat16=(Case("Momentum", lambda: O.Momentum(0.1)),),
        complex_=(Case("Momentum", lambda: O.Momentum(1e-2)),),
        keywords=((lambda: O.Momentum(rho=0.8, lr=0.2), lambda: O.Momentum(0.2, 0.8)),),
        int_hyperparameters=(IntHyper("Momentum(np.int64(1))", lambda: O.Momentum(np.int64(1)), "lr"),),
        bad=(Bad("rho > 1", lambda: O.Momentum(0.1, 1.5), ValueError, r"Momentum: rho must be in \[0, 1\]"),
             Bad("rho schedule above 1", lambda: O.Momentum(0.1, O.Piecewise((10,), (0.9, 1.5))), ValueError,
                 r"Momentum: rho must be in \[0, 1\] at every step, but the schedule .* up to 1.5"),
             Bad("mu_dtype name", lambda: O.Momentum(mu_dtype="float33"), TypeError,
                 "Momentum: mu_dtype must be a real floating dtype"),
             Bad("no nu for Momentum", lambda: O.Momentum(nu_dtype=jnp.bfloat16), TypeError, "nu_dtype")),
        state_dtypes=(StateDtypes("Momentum", lambda **k: O.Momentum(0.01, **k), ("mu",)),),
        # optim keeps v = η·trace (optax keeps the trace and scales it by η): equal while η is constant
        optax=(Parity("Momentum", lambda: O.Momentum(0.01, 0.9), lambda: optax.sgd(0.01, momentum=0.9)),),
        zero1=(Case("Momentum", lambda: O.Momentum(0.1)),),
        kernel=(Kernel("Momentum", lambda: O.Momentum(0.01, mu_dtype=jnp.bfloat16)),),
    ),
    RuleCases(
        O.Nesterov, O.Nesterov(0.001, 0.9), has_lr=True,
        references=(Reference("Nesterov()", lambda: O.Nesterov(), r_nesterov(0.001, 0.9), 5),
                    Reference("Nesterov(.1,.7)", lambda: O.Nesterov(lr=0.1, rho=0.7), r_nesterov(0.1, 0.7), 5)),
        converges=(Converges("Nesterov(1e-2)", lambda: O.Nesterov(1e-2), 0.01),),            # 3.2e-3
        dtypes=(Case("Nesterov", lambda: O.Nesterov()),),
        bfloat16=(Case("Nesterov", lambda: O.Nesterov(0.1)),),
        complex_=(Case("Nesterov", lambda: O.Nesterov(1e-2)),),
        keywords=((lambda: O.Nesterov(rho=0.8, lr=0.2), lambda: O.Nesterov(0.2, 0.8)),),
        optax=(Parity("Nesterov", lambda: O.Nesterov(0.01, 0.9),
                      lambda: optax.sgd(0.01, momentum=0.9, nesterov=True)),),
        zero1=(Case("Nesterov", lambda: O.Nesterov(0.1)),),
    ),
    RuleCases(
        O.Rprop, O.Rprop(1e-3, (0.5, 1.2), (1e-6, 50.0)), has_lr=True,
        references=(Reference("Rprop()", lambda: O.Rprop(), r_rprop(1e-3, (0.5, 1.2), (1e-6, 50.0)), 5),
                    Reference("Rprop(clamped)", lambda: O.Rprop(lr=0.1, ell=(0.4, 1.5), gamma=(0.03, 0.2)),
                              r_rprop(0.1, (0.4, 1.5), (0.03, 0.2)), 8)),
        converges=(Converges("Rprop()", lambda: O.Rprop(), 0.3),),                            # 9.2e-2
        dtypes=(Case("Rprop", lambda: O.Rprop()),),
        bfloat16=(Case("Rprop", lambda: O.Rprop(0.1)),),
        keywords=((lambda: O.Rprop(gamma=(1e-5, 10.0), ell=(0.4, 1.3), lr=0.2),
                   lambda: O.Rprop(0.2, (0.4, 1.3), (1e-5, 10.0))),),
        no_optax="optax.rprop is another variant of Rprop (measured: 37% apart after test_parity's 100 float64 "
                 "steps); optim's is Optimisers.jl's, checked by its numpy reference",
        zero1=(Case("Rprop", lambda: O.Rprop(0.01)),),
    ),
    RuleCases(
        O.RMSProp, O.RMSProp(0.001, 0.9, 1e-8, False), has_lr=True,
        references=(
            Reference("RMSProp()", lambda: O.RMSProp(), r_rmsprop(0.001, 0.9, 1e-8), 5),
            Reference("RMSProp(centred)", lambda: O.RMSProp(centred=True), r_rmsprop(0.001, 0.9, 1e-8, centred=True),
                      5),
            Reference("RMSProp(.05,.8,1e-3)", lambda: O.RMSProp(lr=0.05, rho=0.8, eps=1e-3),
                      r_rmsprop(0.05, 0.8, 1e-3), 5),
            Reference("RMSProp(.05,.8,1e-3,centred)", lambda: O.RMSProp(lr=0.05, rho=0.8, eps=1e-3, centred=True),
                      r_rmsprop(0.05, 0.8, 1e-3, centred=True), 5)),
        converges=(Converges("RMSProp(1e-2)", lambda: O.RMSProp(1e-2), 0.01),                 # 7.0e-4
                   Converges("RMSProp(1e-2,centred)", lambda: O.RMSProp(1e-2, centred=True), 0.01)),  # 6.8e-4
        dtypes=(Case("RMSProp", lambda: O.RMSProp()), Case("RMSPropC", lambda: O.RMSProp(centred=True))),
        bfloat16=(Case("RMSProp", lambda: O.RMSProp(0.1)), Case("RMSPropC", lambda: O.RMSProp(0.1, centred=True))),
        complex_=(Case("RMSProp", lambda: O.RMSProp(1e-2)),),
        keywords=((lambda: O.RMSProp(eps=1e-6, rho=0.8, lr=0.2, centred=True),
                   lambda: O.RMSProp(0.2, 0.8, 1e-6, True)),),
        bad=(Bad("eps inf", lambda: O.RMSProp(eps=float("inf")), ValueError, "RMSProp: eps must be >= 0 and finite"),),
        structural=(Bad("RMSProp centred", lambda: O.RMSProp(centred="yes"), TypeError,
                        "RMSProp: centred must be True or False"),),
        optax=(Parity("RMSProp", lambda: O.RMSProp(0.01, 0.9, 1e-8),
                      lambda: optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False)),
               Parity("RMSProp_centred", lambda: O.RMSProp(0.01, 0.9, 1e-8, centred=True),
                      lambda: optax.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False, centered=True))),
        optax_differs=(Differs("RMSProp eps inside sqrt", lambda: O.RMSProp(0.01, 0.9, 1e-3),
                               lambda: optax.rmsprop(0.01, decay=0.9, eps=1e-3),
                               "optim adds ε outside the square root, optax inside it by default "
                               "(`eps_in_sqrt=False` matches; centred: `centered=True`)"),),
        zero1=(Case("RMSProp", lambda: O.RMSProp(0.01)),),
        kernel=(Kernel("RMSProp", lambda: O.RMSProp(0.01)),
                Kernel("RMSProp centred", lambda: O.RMSProp(0.01, rho=0.8, eps=1e-6, centred=True))),
    ),
    RuleCases(
        O.Adam, O.Adam(0.001, (0.9, 0.999), 1e-8), has_lr=True,
        references=(Reference("Adam()", lambda: O.Adam(), r_adam(0.001, (0.9, 0.999), 1e-8), 5),
                    Reference("Adam(.1,(.8,.95),1e-6)", lambda: O.Adam(lr=0.1, beta=(0.8, 0.95), eps=1e-6),
                              r_adam(0.1, (0.8, 0.95), 1e-6), 5)),
        stacked=(Case("Adam+schedule", lambda: O.Adam(O.Linear(0.1, 0.01, 4))),
                 Case("Adam(bf16 m,v)", lambda: O.Adam(0.1, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16))),
        converges=(Converges("Adam(1e-2)", lambda: O.Adam(1e-2), 0.01),),                     # 1.4e-4
        dtypes=(Case("Adam", lambda: O.Adam()),),
        bfloat16=(Case("Adam", lambda: O.Adam(0.1)),),
        complex_=(Case("Adam", lambda: O.Adam(1e-2)),),
        keywords=((lambda: O.Adam(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.Adam(0.2, (0.8, 0.9), 1e-6)),),
        bad=(Bad("lr inf", lambda: O.Adam(float("inf")), ValueError, "Adam: lr must be >= 0 and finite, got inf"),
             Bad("lr jnp.nan", lambda: O.Adam(jnp.nan), ValueError, "Adam: lr must be >= 0 and finite, got nan"),
             Bad("lr str", lambda: O.Adam("0.1"), TypeError,
                 "Adam: lr must be a real number, an array or an optim schedule, got str"),
             Bad("lr None", lambda: O.Adam(None), TypeError, "Adam: lr must be a real number.*got NoneType"),
             Bad("beta2 = 1", lambda: O.Adam(beta=(0.9, 1.0)), ValueError,
                 r"Adam: beta\[1\] must be in \[0, 1\) and finite, got 1.0"),
             Bad("beta scalar", lambda: O.Adam(beta=0.9), TypeError,
                 r"Adam: beta must be a pair of numbers such as beta=\(0.9, 0.999\), got float 0.9"),
             Bad("lr array", lambda: O.Adam(jnp.array([0.1, 0.2])), ValueError,
                 r"Adam: lr must be a scalar, got an array of shape \(2,\): a hyperparameter is one number"),
             Bad("lr schedule negative", lambda: O.Adam(O.Linear(0.1, -0.1, 10)), ValueError,
                 r"Adam: lr must be >= 0 at every step, but the schedule Linear\(start=0.1, end=-0.1, steps=10\) "
                 r"takes values down to -0.1 \(its range is \[-0.1, 0.1\]\)"),
             Bad("beta schedule reaches 1", lambda: O.Adam(beta=(0.9, O.Linear(0.99, 1.0, 10))), ValueError,
                 r"Adam: beta\[1\] must be in \[0, 1\) at every step, but the schedule .* takes values up to 1"),
             Bad("mu_dtype int", lambda: O.Adam(mu_dtype=jnp.int32), TypeError,
                 "Adam: mu_dtype must be a real floating dtype")),
        state_dtypes=(StateDtypes("Adam", lambda **k: O.Adam(0.01, **k), ("mu", "nu", None)),),
        optax=(Parity("Adam", lambda: O.Adam(0.01), lambda: optax.adam(0.01)),),
        zero1=(Case("Adam", lambda: O.Adam(0.01)),),
        kernel=(Kernel("Adam", lambda: O.Adam(0.01)),
                Kernel("Adam bf16 moments", lambda: O.Adam(0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)),
                Kernel("Adam, a schedule", lambda: O.Adam(O.WSD(0.01, 2, 2, 4)))),
    ),
    RuleCases(
        O.RAdam, O.RAdam(0.001, (0.9, 0.999), 1e-8), has_lr=True,
        # RAdam's default rectification starts at step 5 where rho - 4 ~ 1 comes from 1 - 0.999^t, which float32
        # cannot resolve to 1e-5; steps 1-4 (rho < 4) are exact, the rectified branch is covered with beta2 = 0.9.
        references=(Reference("RAdam()", lambda: O.RAdam(), r_radam(0.001, (0.9, 0.999), 1e-8), 4),
                    Reference("RAdam(.1,(.8,.9))", lambda: O.RAdam(lr=0.1, beta=(0.8, 0.9), eps=1e-6),
                              r_radam(0.1, (0.8, 0.9), 1e-6), 8)),
        converges=(Converges("RAdam(2e-2)", lambda: O.RAdam(2e-2), 0.01),),                   # 5.6e-4
        dtypes=(Case("RAdam", lambda: O.RAdam()),),
        bfloat16=(Case("RAdam", lambda: O.RAdam(0.1)),),
        complex_=(Case("RAdam", lambda: O.RAdam(1e-2)),),
        keywords=((lambda: O.RAdam(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.RAdam(0.2, (0.8, 0.9), 1e-6)),),
        bad=(Bad("mu_dtype number", lambda: O.RAdam(mu_dtype=1.5), TypeError,
                 "RAdam: mu_dtype must be a real floating dtype"),),
        state_dtypes=(StateDtypes("RAdam", lambda **k: O.RAdam(0.01, beta=(0.8, 0.9), **k),    # rectified from t = 5
                                  ("mu", "nu", None, None)),),
        optax=(Parity("RAdam", lambda: O.RAdam(0.01), lambda: optax.radam(0.01, threshold=4.0)),),
        optax_differs=(Differs("RAdam threshold 5", lambda: O.RAdam(0.01), lambda: optax.radam(0.01),
                               "optim rectifies when ρ > 4, optax when ρ >= threshold, 5 by default "
                               "(`threshold=4.0` matches)"),),
        zero1=(Case("RAdam", lambda: O.RAdam(0.01)),),
        kernel=(Kernel("RAdam", lambda: O.RAdam(0.01)),),
    ),
    RuleCases(
        O.AdaMax, O.AdaMax(0.001, (0.9, 0.999), 1e-8), has_lr=True,
        references=(Reference("AdaMax()", lambda: O.AdaMax(), r_adamax(0.001, (0.9, 0.999), 1e-8), 5),
                    Reference("AdaMax(.1,(.8,.95))", lambda: O.AdaMax(lr=0.1, beta=(0.8, 0.95), eps=1e-6),
                              r_adamax(0.1, (0.8, 0.95), 1e-6), 5)),
        converges=(Converges("AdaMax(2e-2)", lambda: O.AdaMax(2e-2), 0.01),),                 # 3.6e-4
        dtypes=(Case("AdaMax", lambda: O.AdaMax()),),
        bfloat16=(Case("AdaMax", lambda: O.AdaMax(0.1)),),
        keywords=((lambda: O.AdaMax(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.AdaMax(0.2, (0.8, 0.9), 1e-6)),),
        optax=(Parity("AdaMax", lambda: O.AdaMax(0.01), lambda: optax.adamax(0.01)),),     # measured: 2e-10
        zero1=(Case("AdaMax", lambda: O.AdaMax(0.01)),),
    ),
    RuleCases(
        O.OAdam, O.OAdam(0.001, (0.5, 0.9), 1e-8), has_lr=True,
        references=(Reference("OAdam()", lambda: O.OAdam(), r_oadam(0.001, (0.5, 0.9), 1e-8), 5),
                    Reference("OAdam(.1,(.6,.95))", lambda: O.OAdam(lr=0.1, beta=(0.6, 0.95), eps=1e-6),
                              r_oadam(0.1, (0.6, 0.95), 1e-6), 5)),
        converges=(Converges("OAdam(1e-2)", lambda: O.OAdam(1e-2), 0.01),),                   # 1.7e-3
        dtypes=(Case("OAdam", lambda: O.OAdam()),),
        bfloat16=(Case("OAdam", lambda: O.OAdam(0.1)),),
        complex_=(Case("OAdam", lambda: O.OAdam(1e-2)),),
        keywords=((lambda: O.OAdam(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.OAdam(0.2, (0.8, 0.9), 1e-6)),),
        no_optax="optax.optimistic_adam is another optimistic step (measured: 73% apart after test_parity's 100 "
                 "float64 steps); optim's is Optimisers.jl's OAdam, checked by its numpy reference",
        zero1=(Case("OAdam", lambda: O.OAdam(0.01)),),
    ),
    RuleCases(
        O.AdaGrad, O.AdaGrad(0.1, 1e-8), has_lr=True,
        references=(Reference("AdaGrad()", lambda: O.AdaGrad(), r_adagrad(0.1, 1e-8), 5),
                    Reference("AdaGrad(.3,1e-4)", lambda: O.AdaGrad(lr=0.3, eps=1e-4), r_adagrad(0.3, 1e-4), 5)),
        converges=(Converges("AdaGrad(.3)", lambda: O.AdaGrad(0.3), 0.01),),                  # 1e-9
        dtypes=(Case("AdaGrad", lambda: O.AdaGrad()),),
        bfloat16=(Case("AdaGrad", lambda: O.AdaGrad(0.1)),),
        complex_=(Case("AdaGrad", lambda: O.AdaGrad(1e-2)),),
        keywords=((lambda: O.AdaGrad(eps=1e-6, lr=0.2), lambda: O.AdaGrad(0.2, 1e-6)),),
        # the closest honest comparison: optax's accumulator started at ε with eps 0 differs by the relative factor
        # ε/(√acc + ε) per step, below 1e-7 in test_parity (|g| >= 0.5 there, so √acc >= 0.5)
        optax=(Parity("AdaGrad", lambda: O.AdaGrad(0.1, 1e-8),
                      lambda: optax.adagrad(0.1, initial_accumulator_value=1e-8, eps=0.0)),),
        optax_differs=(Differs("AdaGrad optax defaults", lambda: O.AdaGrad(0.1, 1e-8), lambda: optax.adagrad(0.1),
                               "optim's accumulator starts at ε and ε is added outside the square root; optax's "
                               "starts at `initial_accumulator_value` (0.1) and adds eps inside `rsqrt`"),),
        zero1=(Case("AdaGrad", lambda: O.AdaGrad(0.1)),),
    ),
    RuleCases(
        O.AdaDelta, O.AdaDelta(0.9, 1e-8),
        references=(Reference("AdaDelta()", lambda: O.AdaDelta(), r_adadelta(0.9, 1e-8), 5),
                    Reference("AdaDelta(.8,1e-3)", lambda: O.AdaDelta(rho=0.8, eps=1e-3), r_adadelta(0.8, 1e-3), 5)),
        converges=(Converges("AdaDelta(.9,1e-6)", lambda: O.AdaDelta(0.9, 1e-6), 0.01),),     # 6.7e-5
        dtypes=(Case("AdaDelta", lambda: O.AdaDelta()),),
        complex_=(Case("AdaDelta", lambda: O.AdaDelta(0.9, 1e-5)),),
        keywords=((lambda: O.AdaDelta(eps=1e-6, rho=0.8), lambda: O.AdaDelta(0.8, 1e-6)),),
        # optax's learning rate scales Optimisers.jl's step: 1.0 is the same rule
        optax=(Parity("AdaDelta", lambda: O.AdaDelta(0.9, 1e-6), lambda: optax.adadelta(1.0, rho=0.9, eps=1e-6)),),
        zero1=(Case("AdaDelta", lambda: O.AdaDelta()),),
    ),
    RuleCases(
        O.AMSGrad, O.AMSGrad(0.001, (0.9, 0.999), 1e-8), has_lr=True,
        references=(Reference("AMSGrad()", lambda: O.AMSGrad(), r_amsgrad(0.001, (0.9, 0.999), 1e-8), 5),
                    Reference("AMSGrad(.1,(.8,.95))", lambda: O.AMSGrad(lr=0.1, beta=(0.8, 0.95), eps=1e-6),
                              r_amsgrad(0.1, (0.8, 0.95), 1e-6), 5)),
        converges=(Converges("AMSGrad(1e-2)", lambda: O.AMSGrad(1e-2), 0.01),),               # 1.3e-7
        dtypes=(Case("AMSGrad", lambda: O.AMSGrad()),),
        bfloat16=(Case("AMSGrad", lambda: O.AMSGrad(0.1)),),
        keywords=((lambda: O.AMSGrad(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.AMSGrad(0.2, (0.8, 0.9), 1e-6)),),
        bad=(Bad("nu_dtype array", lambda: O.AMSGrad(nu_dtype=jnp.zeros(2)), TypeError,
                 "AMSGrad: nu_dtype must be a real floating dtype"),),
        state_dtypes=(StateDtypes("AMSGrad", lambda **k: O.AMSGrad(0.01, **k), ("mu", "nu", "nu")),),
        optax=(Parity("AMSGrad", lambda: O.AMSGrad(0.01, eps=1e-8),
                      lambda: optax.amsgrad(0.01, eps=1e-8, bias_correction_mu=False, bias_correction_nu=False),
                      init=fill_eps(1e-8)),),
        optax_differs=(Differs("AMSGrad with bias correction", lambda: O.AMSGrad(0.01), lambda: optax.amsgrad(0.01),
                               "optim has no bias correction and starts m, v, v̂ at ε; optax corrects both and "
                               "starts at 0 (`bias_correction_mu=False, bias_correction_nu=False` and a state "
                               "filled with ε match)"),),
        zero1=(Case("AMSGrad", lambda: O.AMSGrad(0.01)),),
        kernel=(Kernel("AMSGrad", lambda: O.AMSGrad(0.01)),
                Kernel("AMSGrad bf16 moments", lambda: O.AMSGrad(0.01, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16))),
    ),
    RuleCases(
        O.NAdam, O.NAdam(0.001, (0.9, 0.999), 1e-8), has_lr=True,
        references=(Reference("NAdam()", lambda: O.NAdam(), r_nadam(0.001, (0.9, 0.999), 1e-8), 5),
                    Reference("NAdam(.1,(.8,.95))", lambda: O.NAdam(lr=0.1, beta=(0.8, 0.95), eps=1e-6),
                              r_nadam(0.1, (0.8, 0.95), 1e-6), 5)),
        converges=(Converges("NAdam(1e-2)", lambda: O.NAdam(1e-2), 0.01),),                   # 1.4e-4
        dtypes=(Case("NAdam", lambda: O.NAdam()),),
        bfloat16=(Case("NAdam", lambda: O.NAdam(0.1)),),
        complex_=(Case("NAdam", lambda: O.NAdam(1e-2)),),
        keywords=((lambda: O.NAdam(eps=1e-6, beta=(0.8, 0.9), lr=0.2), lambda: O.NAdam(0.2, (0.8, 0.9), 1e-6)),),
        bad=(Bad("beta1 > 1", lambda: O.NAdam(beta=(1.5, 0.9)), ValueError, r"NAdam: beta\[0\] must be in \[0, 1\)"),),
        state_dtypes=(StateDtypes("NAdam", lambda **k: O.NAdam(0.01, **k), ("mu", "nu", None)),),
        optax=(Parity("NAdam", lambda: O.NAdam(0.01, (0.9, 0.999), 1e-8),
                      lambda: optax.nadam(0.01 / np.sqrt(0.999), b1=0.9, b2=0.999, eps=1e-8 / np.sqrt(0.999))),),
        optax_differs=(Differs("NAdam without the extra beta2", lambda: O.NAdam(0.01), lambda: optax.nadam(0.01),
                               "optim's step has the extra β₂ of √(β₂ v / (1 - β₂ᵗ)); √(β₂ v̂) + ε = "
                               "√β₂ (√v̂ + ε/√β₂), so `optax.nadam(lr / √β₂, eps=ε / √β₂)` is the same formula"),),
        zero1=(Case("NAdam", lambda: O.NAdam(0.01)),),
        # the numerator `m c₁ + g k₂` cancels where the two terms do, so XLA's contracted multiply-add moves the
        # state by more ulp of the moment's scale than Adam's (measured: 5.6 of 4)
        kernel=(Kernel("NAdam", lambda: O.NAdam(0.01), state_ulps=16),),
    ),
    RuleCases(
        O.AdamW, O.AdamW(0.001, (0.9, 0.999), 0.0, 1e-8, True), has_lr=True,
        references=(
            Reference("AdamW()", lambda: O.AdamW(), r_adamw(0.001, (0.9, 0.999), 0.0, 1e-8, True), 5),
            Reference("AdamW(couple=True)",
                      lambda: O.AdamW(lr=0.1, beta=(0.8, 0.95), weight_decay=0.3, eps=1e-6, couple=True),
                      r_adamw(0.1, (0.8, 0.95), 0.3, 1e-6, couple=True), 5),
            Reference("AdamW(couple=False)",
                      lambda: O.AdamW(lr=0.1, beta=(0.8, 0.95), weight_decay=0.3, eps=1e-6, couple=False),
                      r_adamw(0.1, (0.8, 0.95), 0.3, 1e-6, couple=False), 5),
            Reference("AdamW(default lr, wd=.1)", lambda: O.AdamW(0.001, (0.9, 0.999), 0.1),
                      r_adamw(0.001, (0.9, 0.999), 0.1), 5)),
        converges=(Converges("AdamW(1e-2)", lambda: O.AdamW(1e-2), 0.01),                     # 1.4e-4
                   Converges("AdamW(1e-2,couple=False)", lambda: O.AdamW(1e-2, couple=False), 0.01)),  # 1.4e-4
        dtypes=(Case("AdamW", lambda: O.AdamW(weight_decay=0.1)),
                Case("AdamWnc", lambda: O.AdamW(weight_decay=0.1, couple=False))),
        bfloat16=(Case("AdamW", lambda: O.AdamW(0.1, weight_decay=0.1)),),
        complex_=(Case("AdamW", lambda: O.AdamW(1e-2)),),
        keywords=((lambda: O.AdamW(weight_decay=0.3, lr=0.1), lambda: O.AdamW(0.1, (0.9, 0.999), 0.3, 1e-8)),),
        int_hyperparameters=(IntHyper("AdamW(weight_decay=0)", lambda: O.AdamW(1e-3, weight_decay=0),
                                      "weight_decay"),),
        bad=(Bad("beta triple", lambda: O.AdamW(beta=(0.9, 0.99, 0.9)), TypeError, "AdamW: beta must be a pair"),
             Bad("beta numpy array", lambda: O.AdamW(beta=(np.array([0.9]), 0.999)), ValueError,
                 r"AdamW: beta\[0\] must be a scalar, got an array of shape \(1,\)"),
             Bad("nu_dtype complex", lambda: O.AdamW(nu_dtype=jnp.complex64), TypeError,
                 "AdamW: nu_dtype must be a real floating dtype")),
        structural=(Bad("AdamW couple", lambda: O.AdamW(couple=None), TypeError,
                        "AdamW: couple must be True or False, got NoneType"),),
        state_dtypes=(StateDtypes("AdamW", lambda **k: O.AdamW(0.01, weight_decay=0.1, **k), ("mu", "nu", None)),),
        optax=(Parity("AdamW", lambda: O.AdamW(0.01, weight_decay=0.1), lambda: optax.adamw(0.01, weight_decay=0.1)),
               # `couple=False` (λ not scaled by η) has no optax alias: composed from optax's primitives
               Parity("AdamW_decoupled", lambda: O.AdamW(0.01, weight_decay=0.01, couple=False),
                      lambda: optax.chain(optax.scale_by_adam(eps=1e-8), optax.scale(0.01),
                                          optax.add_decayed_weights(0.01), optax.scale(-1.0)))),
        optax_differs=(Differs("AdamW default weight decay", lambda: O.AdamW(0.01), lambda: optax.adamw(0.01),
                               "optim's default λ is 0, optax's 1e-4"),),
        zero1=(Case("AdamW", lambda: O.AdamW(0.01, weight_decay=0.1)),),
        kernel=(Kernel("AdamW", lambda: O.AdamW(0.01, weight_decay=0.1)),
                Kernel("AdamW decoupled", lambda: O.AdamW(0.01, weight_decay=0.01, couple=False))),
    ),
    RuleCases(
        O.AdaBelief, O.AdaBelief(0.001, (0.9, 0.999), 1e-16), has_lr=True,
        references=(Reference("AdaBelief()", lambda: O.AdaBelief(), r_adabelief(0.001, (0.9, 0.999), 1e-16), 5),
                    Reference("AdaBelief(.1,(.8,.95))", lambda: O.AdaBelief(lr=0.1, beta=(0.8, 0.95), eps=1e-8),
                              r_adabelief(0.1, (0.8, 0.95), 1e-8), 5)),
        converges=(Converges("AdaBelief(1e-2)", lambda: O.AdaBelief(1e-2), 0.01),),           # 1e-10
        dtypes=(Case("AdaBelief", lambda: O.AdaBelief()),),
        bfloat16=(Case("AdaBelief", lambda: O.AdaBelief(0.1)),),
        complex_=(Case("AdaBelief", lambda: O.AdaBelief(1e-2)),),
        keywords=((lambda: O.AdaBelief(eps=1e-6, beta=(0.8, 0.9), lr=0.2),
                   lambda: O.AdaBelief(0.2, (0.8, 0.9), 1e-6)),),
        bad=(Bad("beta jax 1", lambda: O.AdaBelief(beta=(0.9, jnp.asarray(1.0))), ValueError,
                 r"AdaBelief: beta\[1\] must be in"),),
        state_dtypes=(StateDtypes("AdaBelief", lambda **k: O.AdaBelief(0.01, **k), ("mu", "nu", None)),),
        # optim adds ε to s every step: optax's `eps_root=ε` (its default eps_root, 1e-16, is optim's ε only by a
        # coincidence of defaults)
        optax=(Parity("AdaBelief", lambda: O.AdaBelief(0.01, eps=1e-16),
                      lambda: optax.adabelief(0.01, eps=1e-16, eps_root=1e-16)),),
        zero1=(Case("AdaBelief", lambda: O.AdaBelief(0.01)),),
        kernel=(Kernel("AdaBelief", lambda: O.AdaBelief(0.01)),
                Kernel("AdaBelief bf16 moments", lambda: O.AdaBelief(0.01, eps=1e-8, mu_dtype=jnp.bfloat16,
                                                                     nu_dtype=jnp.bfloat16))),
    ),
    RuleCases(
        O.ADOPT, O.ADOPT(1e-3, (0.9, 0.9999), 1e-6, False, True), has_lr=True,
        references=(
            Reference("ADOPT()", lambda: O.ADOPT(), r_adopt(1e-3, (0.9, 0.9999), 1e-6), 5),
            # beta2 .9 and a small eps so that |g| / sqrt(v) passes the clip t^(1/4) at some steps
            Reference("ADOPT(.1,(.8,.9),1e-3)", lambda: O.ADOPT(0.1, (0.8, 0.9), 1e-3),
                      r_adopt(0.1, (0.8, 0.9), 1e-3), 8),
            Reference("ADOPT(nesterov)", lambda: O.ADOPT(0.1, (0.8, 0.9), nesterov=True),
                      r_adopt(0.1, (0.8, 0.9), 1e-6, nesterov=True), 8),
            Reference("ADOPT(no clipping)", lambda: O.ADOPT(0.1, (0.8, 0.9), use_clipping=False),
                      r_adopt(0.1, (0.8, 0.9), 1e-6, clip=False), 8)),
        stacked=(Case("ADOPT+schedule", lambda: O.ADOPT(O.Linear(0.1, 0.01, 4))),),
        # 5e-2: at 1e-2 the loss is still .33 after 2000 steps (β₂ = .9999 adapts v slowly)
        converges=(Converges("ADOPT(5e-2)", lambda: O.ADOPT(5e-2), 0.01),),                   # 3.8e-4
        dtypes=(Case("ADOPT", lambda: O.ADOPT()),),
        bfloat16=(Case("ADOPT", lambda: O.ADOPT(0.1)),),
        keywords=((lambda: O.ADOPT(use_clipping=False, eps=1e-5, beta=(0.8, 0.9), lr=0.2),
                   lambda: O.ADOPT(0.2, (0.8, 0.9), 1e-5, False, False)),),
        bad=(Bad("ADOPT beta2 = 1", lambda: O.ADOPT(beta=(0.9, 1.0)), ValueError,
                 r"ADOPT: beta\[1\] must be in \[0, 1\) and finite, got 1.0"),
             Bad("ADOPT eps", lambda: O.ADOPT(eps=-1e-6), ValueError, "ADOPT: eps must be >= 0 and finite")),
        structural=(Bad("ADOPT nesterov", lambda: O.ADOPT(nesterov="no"), TypeError,
                        "ADOPT: nesterov must be True or False, got str 'no'"),
                    Bad("ADOPT use_clipping", lambda: O.ADOPT(use_clipping=1), TypeError,
                        "ADOPT: use_clipping must be True or False, got int 1")),
        x64_optax=(Optax("ADOPT()", lambda: O.ADOPT(0.01), lambda: optax.contrib.adopt(0.01), defaults=True),
                   Optax("ADOPT(all,nesterov)", lambda: O.ADOPT(0.05, (0.8, 0.99), 1e-4, nesterov=True),
                         lambda: optax.contrib.adopt(0.05, b1=0.8, b2=0.99, eps=1e-4, nesterov=True))),
        adjust=((lambda: O.ADOPT(0.01), [{"lr": 0.001}, {"beta": (0.5, 0.9), "eps": 1e-4}]),),
        # the conventions of `optax.contrib.adopt` (no difference to pin), each structural switch: optax's count is
        # global and optim's per parameter, equal when every parameter has a gradient at every step. Measured:
        # relative difference below 1e-12 after 100 steps.
        optax=(Parity("ADOPT defaults", lambda: O.ADOPT(0.01), lambda: optax.contrib.adopt(0.01), **_TIGHT),
               Parity("ADOPT beta,eps", lambda: O.ADOPT(0.01, (0.8, 0.99), 1e-3),
                      lambda: optax.contrib.adopt(0.01, b1=0.8, b2=0.99, eps=1e-3), **_TIGHT),
               Parity("ADOPT nesterov", lambda: O.ADOPT(0.01, (0.8, 0.99), nesterov=True),
                      lambda: optax.contrib.adopt(0.01, b1=0.8, b2=0.99, nesterov=True), **_TIGHT),
               Parity("ADOPT no clipping", lambda: O.ADOPT(0.01, (0.8, 0.99), use_clipping=False),
                      lambda: optax.contrib.adopt(0.01, b1=0.8, b2=0.99, use_clipping=False), **_TIGHT),
               Parity("ADOPT schedule", lambda: O.ADOPT(O.Linear(0.02, 0.001, 50)),
                      lambda: optax.contrib.adopt(_linear64(0.02, 0.001, 50)), **_TIGHT)),
        zero1=(Case("ADOPT", lambda: O.ADOPT(0.01)),),
        # the first step only sets v; then clipped at t^¼ (or not), plain or Nesterov
        kernel=(Kernel("ADOPT", lambda: O.ADOPT(0.01)),
                Kernel("ADOPT nesterov, unclipped", lambda: O.ADOPT(0.01, beta=(0.9, 0.99), nesterov=True,
                                                                    use_clipping=False))),
    ),
    RuleCases(
        O.AdEMAMix, O.AdEMAMix(1e-3, (0.9, 0.999), 0.9999, 5.0, 1e-8, 0.0), has_lr=True,
        references=(
            Reference("AdEMAMix()", lambda: O.AdEMAMix(), r_ademamix(1e-3, (0.9, 0.999), 0.9999, 5.0, 1e-8, 0.0), 5),
            # beta3 .9 so that the slow moment is not ~0 within 8 steps
            Reference("AdEMAMix(.1,(.8,.95),.9,2,1e-6,.1)", lambda: O.AdEMAMix(0.1, (0.8, 0.95), 0.9, 2.0, 1e-6, 0.1),
                      r_ademamix(0.1, (0.8, 0.95), 0.9, 2.0, 1e-6, 0.1), 8)),
        stacked=(Case("AdEMAMix+warmups", lambda: O.AdEMAMix(0.1, beta3=O.Linear(0.5, 0.99, 4),
                                                              alpha=O.Linear(0.0, 5.0, 4), weight_decay=0.1)),),
        # beta3 .999: with the default .9999 the slow moment is still filling after 2000 steps (loss 5.5e-2; the
        # paper's appendix C.1.5 advises a smaller beta3 for short runs)
        converges=(Converges("AdEMAMix(1e-2,b3=.999)", lambda: O.AdEMAMix(1e-2, beta3=0.999), 0.01),),  # 3.0e-3
        dtypes=(Case("AdEMAMix", lambda: O.AdEMAMix(weight_decay=0.1)),),
        bfloat16=(Case("AdEMAMix", lambda: O.AdEMAMix(0.1, beta3=0.9, weight_decay=0.1)),),
        complex_=(Case("AdEMAMix", lambda: O.AdEMAMix(1e-2, beta3=0.99)),),
        keywords=((lambda: O.AdEMAMix(weight_decay=0.1, eps=1e-6, alpha=2.0, beta3=0.99, beta=(0.8, 0.9), lr=0.2),
                   lambda: O.AdEMAMix(0.2, (0.8, 0.9), 0.99, 2.0, 1e-6, 0.1)),),
        int_hyperparameters=(IntHyper("AdEMAMix(alpha=5)", lambda: O.AdEMAMix(alpha=5), "alpha"),),
        bad=(Bad("AdEMAMix beta3 = 1", lambda: O.AdEMAMix(beta3=1.0), ValueError,
                 r"AdEMAMix: beta3 must be in \[0, 1\) and finite, got 1.0"),
             Bad("AdEMAMix alpha < 0", lambda: O.AdEMAMix(alpha=-1.0), ValueError,
                 "AdEMAMix: alpha must be >= 0 and finite, got -1.0"),
             Bad("AdEMAMix beta3 schedule to 1", lambda: O.AdEMAMix(beta3=O.Linear(0.9, 1.0, 10)), ValueError,
                 r"AdEMAMix: beta3 must be in \[0, 1\) at every step, but the schedule .* takes values up to 1"),
             Bad("AdEMAMix beta triple", lambda: O.AdEMAMix(beta=(0.9, 0.99, 0.999)), TypeError,
                 "AdEMAMix: beta must be a pair")),
        x64_optax=(Optax("AdEMAMix()", lambda: O.AdEMAMix(0.01), lambda: optax.contrib.ademamix(0.01),
                         defaults=True),
                   Optax("AdEMAMix(all)", lambda: O.AdEMAMix(0.05, (0.8, 0.99), 0.9, 3.0, 1e-5, 0.1),
                         lambda: optax.contrib.ademamix(0.05, b1=0.8, b2=0.99, b3=0.9, alpha=3.0, eps=1e-5,
                                                        weight_decay=0.1))),
        adjust=((lambda: O.AdEMAMix(0.01, weight_decay=0.1),
                 [{"lr": 0.001},
                  {"beta": (0.5, 0.9), "beta3": 0.99, "alpha": 2.0, "eps": 1e-4, "weight_decay": 0.0}]),),
        # the conventions of `optax.contrib.ademamix` (no difference to pin), also with α and β₃ warmups as
        # schedules: optax calls them with its `count_m2` (0 on the first update), optim with the number of updates
        # so far, the same. Measured: relative difference below 1e-12 after 100 steps.
        optax=(Parity("AdEMAMix defaults", lambda: O.AdEMAMix(0.01), lambda: optax.contrib.ademamix(0.01), **_TIGHT),
               Parity("AdEMAMix all", lambda: O.AdEMAMix(0.02, (0.8, 0.99), 0.99, 3.0, 1e-6, 0.1),
                      lambda: optax.contrib.ademamix(0.02, b1=0.8, b2=0.99, b3=0.99, alpha=3.0, eps=1e-6,
                                                     weight_decay=0.1), **_TIGHT),
               Parity("AdEMAMix warmups", lambda: O.AdEMAMix(0.01, beta3=PaperBeta3(0.9, 0.999, 60),
                                                             alpha=O.Linear(0.0, 5.0, 80), weight_decay=0.1),
                      lambda: optax.contrib.ademamix(0.01, b3=PaperBeta3(0.9, 0.999, 60), alpha=_linear64(0.0, 5.0, 80),
                                                     weight_decay=0.1), **_TIGHT),
               Parity("AdEMAMix linear beta3, lr schedule",
                      lambda: O.AdEMAMix(O.Linear(0.02, 0.001, 50), beta3=O.Linear(0.5, 0.99, 30)),
                      lambda: optax.contrib.ademamix(_linear64(0.02, 0.001, 50), b3=_linear64(0.5, 0.99, 30)),
                      **_TIGHT)),
        zero1=(Case("AdEMAMix", lambda: O.AdEMAMix(0.01, beta3=0.99, weight_decay=0.1)),),
        # the paper's α warmup, and a β₃ that moves: both are numbers of the step, given to the kernel per call
        kernel=(Kernel("AdEMAMix", lambda: O.AdEMAMix(0.01, weight_decay=0.1)),
                Kernel("AdEMAMix, schedules", lambda: O.AdEMAMix(0.01, beta3=O.Linear(0.9, 0.999, 4),
                                                                 alpha=O.Linear(0.0, 5.0, 4)))),
    ),
    # MARS's correction divides by the norm of the whole parameter where it exceeds 1: a reference case runs on
    # scalars, vectors and matrices; the vectors' c mostly exceeds 1, with γ = 0 (c = g) 3 of the 8 do not
    RuleCases(
        O.MARS, O.MARS(3e-3, (0.95, 0.99), 0.025, 1e-8, 0.0), has_lr=True, reduces_over_parameter=True,
        references=(
            Reference("MARS()", lambda: O.MARS(), r_mars(), 8),
            # γ .5: the correction (g - g₋) weighs 4.5 times g
            Reference("MARS(all)", lambda: O.MARS(0.01, (0.9, 0.95), 0.5, 1e-3, 0.1),
                      r_mars(0.01, (0.9, 0.95), 0.5, 1e-3, 0.1), 8),
            Reference("MARS(gamma 0)", lambda: O.MARS(0.05, gamma=0.0), r_mars(0.05, gamma=0.0), 8)),
        stacked=(Case("MARS+schedule", lambda: O.MARS(O.Linear(0.1, 0.01, 4), gamma=O.Linear(0.5, 0.0, 4),
                                                      weight_decay=0.1)),),
        converges=(Converges("MARS(1e-2)", lambda: O.MARS(1e-2), 0.01),),                       # 3.3e-7
        dtypes=(Case("MARS", lambda: O.MARS()),),
        bfloat16=(Case("MARS", lambda: O.MARS(0.1)),),
        complex_=(Case("MARS", lambda: O.MARS(0.01)),),
        keywords=((lambda: O.MARS(weight_decay=0.1, eps=1e-6, gamma=0.5, beta=(0.9, 0.95), lr=0.2),
                   lambda: O.MARS(0.2, (0.9, 0.95), 0.5, 1e-6, 0.1)),),
        bad=(Bad("MARS beta1 = 1", lambda: O.MARS(beta=(1.0, 0.99)), ValueError,
                 r"MARS: beta\[0\] must be in \[0, 1\) and finite, got 1.0"),
             Bad("MARS gamma", lambda: O.MARS(gamma=-0.1), ValueError, "MARS: gamma must be >= 0 and finite"),
             Bad("MARS eps", lambda: O.MARS(eps=float("nan")), ValueError, "MARS: eps must be >= 0 and finite")),
        adjust=((lambda: O.MARS(0.01), [{"lr": 0.001}, {"beta": (0.5, 0.9), "gamma": 0.1, "eps": 1e-4,
                                                         "weight_decay": 0.1}]),),
        no_optax="optax 0.2.8 has no MARS (optax PRs #1560, #1562, #1689, #1697 propose one, unmerged): compared "
                 "with a float64 numpy reference from the paper's code (r_mars)",
        zero1=(Case("MARS", lambda: O.MARS(0.01, weight_decay=0.1)),),
    ),
    RuleCases(
        O.Lion, O.Lion(1e-4, (0.9, 0.99)), has_lr=True,
        references=(Reference("Lion()", lambda: O.Lion(), r_lion(1e-4, (0.9, 0.99)), 5),
                    Reference("Lion(.1,(.8,.95))", lambda: O.Lion(lr=0.1, beta=(0.8, 0.95)), r_lion(0.1, (0.8, 0.95)),
                              5)),
        stacked=(Case("Lion(bf16 m)", lambda: O.Lion(0.1, mu_dtype=jnp.bfloat16)),),
        converges=(Converges("Lion(3e-3)", lambda: O.Lion(3e-3), 0.01),),                     # 5.9e-5
        dtypes=(Case("Lion", lambda: O.Lion()),),
        bfloat16=(Case("Lion", lambda: O.Lion(0.1)),),
        keywords=((lambda: O.Lion(beta=(0.8, 0.9), lr=0.2), lambda: O.Lion(0.2, (0.8, 0.9))),),
        bad=(Bad("beta negative", lambda: O.Lion(beta=(0.9, -0.1)), ValueError, r"Lion: beta\[1\] must be in \[0, 1\)"),
             Bad("beta schedule grows", lambda: O.Lion(beta=(O.Exponential(0.5, 1.1, 10), 0.99)), ValueError,
                 r"Lion: beta\[0\] must be in \[0, 1\) at every step, but the schedule .* takes values up to inf"),
             Bad("mu_dtype bool", lambda: O.Lion(mu_dtype=bool), TypeError,
                 "Lion: mu_dtype must be a real floating dtype"),
             Bad("no nu for Lion", lambda: O.Lion(nu_dtype=jnp.bfloat16), TypeError, "nu_dtype")),
        state_dtypes=(StateDtypes("Lion", lambda **k: O.Lion(0.01, **k), ("mu",)),),
        optax=(Parity("Lion", lambda: O.Lion(0.001, (0.9, 0.99)),
                      lambda: optax.lion(0.001, b1=0.9, b2=0.99, weight_decay=0.0)),),
        optax_differs=(Differs("Lion default weight decay", lambda: O.Lion(0.001), lambda: optax.lion(0.001),
                               "optax.lion's default weight_decay is 1e-3; optim's Lion has none "
                               "(`weight_decay=0.0` matches)"),),
        zero1=(Case("Lion", lambda: O.Lion(0.01)),),
        kernel=(Kernel("Lion", lambda: O.Lion(0.01)),),
    ),
    RuleCases(
        O.WeightDecay, O.WeightDecay(5e-4),
        references=(Reference("WeightDecay()", lambda: O.WeightDecay(), r_weightdecay(5e-4), 5),
                    Reference("WeightDecay(.3)", lambda: O.WeightDecay(weight_decay=0.3), r_weightdecay(0.3), 5)),
        # the decay biases w away from w'
        converges=(Converges("WeightDecay()", lambda: O.WeightDecay(), 0.01),),               # 8.5e-4
        dtypes=(Case("WeightDecay", lambda: O.WeightDecay()),),
        keywords=((lambda: O.WeightDecay(weight_decay=0.2), lambda: O.WeightDecay(0.2)),),
        no_optax="a stateless stage: optax.add_decayed_weights is the same one-line formula (measured equal to "
                 "1e-15 after 100 float64 steps); its numpy reference checks it",
        zero1=(Case("WeightDecay", lambda: O.chain(O.WeightDecay(0.1), O.Descent(0.1))),),
    ),
    RuleCases(
        O.SignDecay, O.SignDecay(1e-3),
        references=(Reference("SignDecay()", lambda: O.SignDecay(), r_signdecay(1e-3), 5),
                    Reference("SignDecay(.3)", lambda: O.SignDecay(weight_decay=0.3), r_signdecay(0.3), 5)),
        converges=(Converges("SignDecay()", lambda: O.SignDecay(), 0.01),),                   # 3.3e-3 (likewise)
        dtypes=(Case("SignDecay", lambda: O.SignDecay()),),
        keywords=((lambda: O.SignDecay(weight_decay=0.2), lambda: O.SignDecay(0.2)),),
        no_optax="optax has no decay by the sign of the parameter",
        zero1=(Case("SignDecay", lambda: O.chain(O.SignDecay(0.01), O.Descent(0.1))),),
    ),
    RuleCases(
        O.ClipGrad, O.ClipGrad(10.0),
        references=(Reference("ClipGrad()", lambda: O.ClipGrad(), r_clipgrad(10.0), 5),
                    Reference("ClipGrad(1.5)", lambda: O.ClipGrad(delta=1.5), r_clipgrad(1.5), 5)),
        converges=(Converges("ClipGrad()", lambda: O.ClipGrad(), 0.01),),                     # 2.5e-13
        dtypes=(Case("ClipGrad", lambda: O.ClipGrad()),),
        keywords=((lambda: O.ClipGrad(delta=2.5), lambda: O.ClipGrad(2.5)),),
        int_hyperparameters=(IntHyper("ClipGrad(2)", lambda: O.ClipGrad(2), "delta"),),
        no_optax="a stateless stage: optax.clip is the same clamp (measured equal after 100 float64 steps); its "
                 "numpy reference checks it",
        zero1=(Case("ClipGrad", lambda: O.chain(O.ClipGrad(0.5), O.Descent(0.1))),),
    ),
    RuleCases(
        O.ClipNorm, O.ClipNorm(10.0, 2), reduces_over_parameter=True,
        references=(
            Reference("ClipNorm()", lambda: O.ClipNorm(), r_clipnorm(10.0, 2), 5),
            Reference("ClipNorm(4,p=2)", lambda: O.ClipNorm(max_norm=4.0, p=2), r_clipnorm(4.0, 2), 5),
            Reference("ClipNorm(6,p=1)", lambda: O.ClipNorm(max_norm=6.0, p=1), r_clipnorm(6.0, 1), 5),
            Reference("ClipNorm(2,p=inf)", lambda: O.ClipNorm(max_norm=2.0, p=float("inf")), r_clipnorm(2.0, np.inf),
                      5),
            Reference("ClipNorm(5.5,p=0)", lambda: O.ClipNorm(max_norm=5.5, p=0), r_clipnorm(5.5, 0), 5)),
        converges=(Converges("ClipNorm()", lambda: O.ClipNorm(), 0.01),),                     # 2.5e-13
        dtypes=(Case("ClipNorm", lambda: O.ClipNorm()),),
        keywords=((lambda: O.ClipNorm(p=1, max_norm=2.5), lambda: O.ClipNorm(2.5, 1)),),
        int_hyperparameters=(IntHyper("ClipNorm(1)", lambda: O.ClipNorm(1), "max_norm"),),
        bad=(Bad("ClipNorm p", lambda: O.ClipNorm(1.0, p="2"), TypeError, "ClipNorm: p must be a number"),),
        no_optax="optax has no per-parameter p-norm clip (clip_by_block_rms clips the RMS, clip_by_global_norm the "
                 "whole model's 2-norm)",
        zero1=(Case("ClipNorm", lambda: O.OptimiserChain(O.ClipNorm(0.5), O.Adam(0.01))),),
    ),
    RuleCases(
        O.OptimiserChain,
        # chains (R1's list)
        references=(
            Reference("Chain(ClipGrad(1),Momentum(.1))",
                      lambda: O.OptimiserChain(O.ClipGrad(1.0), O.Momentum(0.1, 0.9)),
                      r_chain(r_clipgrad(1.0), r_momentum(0.1, 0.9)), 5),
            Reference("Chain(WD(.1),OAdam(.1),ClipGrad(1))",
                      lambda: O.OptimiserChain(O.WeightDecay(0.1), O.OAdam(0.1), O.ClipGrad(1.0)),
                      r_chain(r_weightdecay(0.1), r_oadam(0.1), r_clipgrad(1.0)), 5),
            Reference("Chain(SignDecay(.1),Adam(.1))", lambda: O.chain(O.SignDecay(0.1), O.Adam(0.1)),
                      r_chain(r_signdecay(0.1), r_adam(0.1)), 5),
            Reference("Chain(ClipNorm(2),Adam(.1))", lambda: O.OptimiserChain(O.ClipNorm(2.0), O.Adam(0.1)),
                      r_chain(r_clipnorm(2.0, 2), r_adam(0.1)), 5),
            Reference("Chain()", lambda: O.OptimiserChain(), r_descent(1.0), 5)),
        converges=(
            Converges("Chain(SignDecay,Adam(1e-2))", lambda: O.chain(O.SignDecay(), O.Adam(1e-2)), 0.01),  # 3.3e-3
            Converges("Chain(ClipNorm,Adam(1e-2))", lambda: O.chain(O.ClipNorm(), O.Adam(1e-2)), 0.01),    # 1.4e-4
            Converges("Chain(ClipGrad(.5),Momentum)", lambda: O.chain(O.ClipGrad(0.5), O.Momentum()), 0.01),  # 3.2e-3
            Converges("Chain(WD,OAdam(1e-2),ClipGrad(1))",
                      lambda: O.chain(O.WeightDecay(), O.OAdam(1e-2), O.ClipGrad(1)), 0.01)),             # 2.7e-3
        dtypes=(Case("Chain(ClipGrad,Momentum)", lambda: O.OptimiserChain(O.ClipGrad(0.5), O.Momentum())),),
        no_optax="a composition: each stage is compared on its own entry (optax.chain composes the same way: "
                 "AdamW_decoupled's parity case, test_state.py's chain(Adam, Scale))",
    ),
    RuleCases(
        O.MixedPrecision,
        references=(Reference("MixedPrecision(f32,Adam(.1))", lambda: O.MixedPrecision(jnp.float32, O.Adam(0.1)),
                              r_adam(0.1), 5),),
        converges=(Converges("MixedPrecision(f32,Adam(1e-2))", lambda: O.MixedPrecision(jnp.float32, O.Adam(1e-2)),
                             0.01),),                                                            # 1.4e-4
        dtypes=(Case("MixedPrecision(f32,Adam)", lambda: O.MixedPrecision(jnp.float32, O.Adam())),),
        structural=(Bad("MixedPrecision rule", lambda: O.MixedPrecision(jnp.float32, 0.1), TypeError,
                        r"MixedPrecision: rule must be a rule \(it needs init and apply\), got 0.1"),),
        no_optax="optax has no wrapper that keeps float32 copies of low-precision parameters",
        zero1=(Case("MixedPrecision", lambda: O.MixedPrecision(jnp.float32, O.Adam(0.01))),),
    ),
    RuleCases(
        O.StochasticRounding,
        # float32 parameters take the inner rule's step: its reference
        references=(Reference("StochasticRounding(Adam(.1))", lambda: O.StochasticRounding(O.Adam(0.1), seed=3),
                              r_adam(0.1), 5),),
        stacked=(Case("StochasticRounding(AccumGrad(2)+Adam)",
                      lambda: O.StochasticRounding(O.chain(O.AccumGrad(2), O.Adam(0.1)))),),
        converges=(Converges("StochasticRounding(Adam(1e-2))", lambda: O.StochasticRounding(O.Adam(1e-2)),
                             0.01),),
        dtypes=(Case("StochasticRounding(Adam)", lambda: O.StochasticRounding(O.Adam())),),
        bfloat16=(Case("StochasticRounding(AdamW)", lambda: O.StochasticRounding(O.AdamW(0.1, weight_decay=0.1))),),
        structural=(Bad("StochasticRounding rule", lambda: O.StochasticRounding(0.1), TypeError,
                        r"StochasticRounding: rule must be a rule \(it needs init and apply\), got 0.1"),
                    Bad("StochasticRounding seed", lambda: O.StochasticRounding(O.Adam(), seed=1.5), TypeError,
                        "StochasticRounding: seed must be an integer, got float 1.5"),
                    Bad("StochasticRounding seed<0", lambda: O.StochasticRounding(O.Adam(), seed=-1), ValueError,
                        r"StochasticRounding: seed must be an integer in \[0, 2\^64\), got -1")),
        no_optax="optax has no stochastic rounding of the parameters' new values",
        zero1=(Case("StochasticRounding", lambda: O.StochasticRounding(O.Adam(0.01), seed=1)),),
    ),
    RuleCases(
        O.AccumGrad,
        stacked=(Case("AccumGrad(2)+Adam", lambda: O.OptimiserChain(O.AccumGrad(2), O.Adam(0.1))),),
        dtypes=(Case("Chain(AccumGrad(2),Adam)", lambda: O.OptimiserChain(O.AccumGrad(2), O.Adam())),),
        keywords=((lambda: O.AccumGrad(n=3), lambda: O.AccumGrad(3)),),
        bad=(Bad("AccumGrad(0)", lambda: O.AccumGrad(0), ValueError, "AccumGrad: n must be an integer >= 1, got 0"),
             Bad("AccumGrad(jnp 0)", lambda: O.AccumGrad(jnp.asarray(0)), ValueError,
                 "AccumGrad: n must be an integer >= 1"),
             Bad("AccumGrad(2.5)", lambda: O.AccumGrad(2.5), ValueError,
                 "AccumGrad: n must be an integer >= 1, got 2.5"),
             Bad("AccumGrad('2')", lambda: O.AccumGrad("2"), TypeError, "AccumGrad: n must be an integer, got str")),
        no_optax="optax.MultiSteps also averages n gradients, but wraps a whole optimiser (its own state, zero "
                 "updates in between) where AccumGrad is a chain stage: not compared",
        zero1=(Case("AccumGrad", lambda: O.chain(O.AccumGrad(2), O.Adam(0.01))),),
    ),
    RuleCases(
        O.ClipGlobalNorm, reduces_over_parameter=True,
        stacked=(Case("ClipGlobalNorm(1)+Adam", lambda: O.OptimiserChain(O.ClipGlobalNorm(1.0), O.Adam(0.1))),),
        int_hyperparameters=(IntHyper("ClipGlobalNorm(1)", lambda: O.ClipGlobalNorm(1), "max_norm"),),
        no_optax="compared with optax.clip_by_global_norm in test_global_rules.py, where optax counts a tie twice "
                 "and optim once (untied they agree: measured equal after 100 float64 steps)",
        zero1=(Case("ClipGlobalNorm", lambda: O.chain(O.ClipGlobalNorm(0.5), O.Adam(0.01))),),
        # the clip factor scales the gradient inside the kernel; 5.0 clips at every step there (norms 44-50)
        kernel=(Kernel("chain(ClipGlobalNorm, AdamW)", lambda: O.chain(O.ClipGlobalNorm(5.0),
                                                                       O.AdamW(0.01, weight_decay=0.1))),
                Kernel("chain(ClipGlobalNorm, Lion)", lambda: O.chain(O.ClipGlobalNorm(5.0), O.Lion(0.01))),
                Kernel("chain(ClipGlobalNorm, AdamW, Scale)",
                       lambda: O.chain(O.ClipGlobalNorm(5.0), O.AdamW(0.01, weight_decay=0.1), O.Scale(-0.7)))),
    ),
    RuleCases(
        O.SkipNonFinite, reduces_over_parameter=True,
        stacked=(Case("SkipNonFinite(Adam)", lambda: O.SkipNonFinite(O.Adam(0.1))),),
        structural=(Bad("SkipNonFinite rule", lambda: O.SkipNonFinite(None), TypeError,
                        r"SkipNonFinite: rule must be a rule \(it needs init and apply\), got None"),),
        no_optax="optax.apply_if_finite also applies the update after max_consecutive_errors skips; from_optax "
                 "refuses it and names SkipNonFinite (test_optax.py)",
        zero1=(Case("SkipNonFinite", lambda: O.SkipNonFinite(O.Adam(0.01))),),
        # the gates' flags and counters by the wrappers' own code, the step (and an EMA) in the kernel
        kernel=(Kernel("SkipNonFinite(AdamW)", lambda: O.SkipNonFinite(O.AdamW(0.01, weight_decay=0.1))),
                # sigma 0.5 after one norm: some steps are skipped (the norms grow with t), some not
                Kernel("SkipNonFinite(SkipLargeUpdates(EMA(Momentum)))", lambda: O.SkipNonFinite(O.SkipLargeUpdates(
                    O.EMA(O.Momentum(0.01), decay=O.Linear(0.5, 0.9, 3)), sigma=0.5, warmup=1))),
                Kernel("SkipNonFinite(chain(ClipGlobalNorm, RMSProp centred))", lambda: O.SkipNonFinite(O.chain(
                    O.ClipGlobalNorm(5.0), O.RMSProp(0.01, centred=True)))),
                Kernel("SkipNonFinite(EMA(AMSGrad))", lambda: O.SkipNonFinite(O.EMA(O.AMSGrad(0.01), decay=0.9))),
                Kernel("SkipNonFinite(RAdam)", lambda: O.SkipNonFinite(O.RAdam(0.01))),
                Kernel("SkipNonFinite(chain(ClipGlobalNorm, AdEMAMix))", lambda: O.SkipNonFinite(O.chain(
                    O.ClipGlobalNorm(5.0), O.AdEMAMix(0.01))))),
    ),
    RuleCases(
        O.Cautious, reduces_over_parameter=True,
        # the inner rule's reference without its decay; the decay (lr * lam * x, or lam * x) added unmasked
        references=(
            Reference("Cautious(Adam(.1))", lambda: O.Cautious(O.Adam(0.1)), r_cautious(r_adam(0.1)), 5),
            Reference("Cautious(AdamW(couple=True))",
                      lambda: O.Cautious(O.AdamW(0.1, (0.8, 0.95), weight_decay=0.3, eps=1e-6)),
                      r_cautious(r_adamw(0.1, (0.8, 0.95), 0.0, 1e-6), lambda x: f32(0.1) * f32(0.3) * x), 5),
            Reference("Cautious(AdamW(couple=False))",
                      lambda: O.Cautious(O.AdamW(0.1, (0.8, 0.95), weight_decay=0.3, eps=1e-6, couple=False)),
                      r_cautious(r_adamw(0.1, (0.8, 0.95), 0.0, 1e-6), lambda x: f32(0.3) * x), 5),
            Reference("Cautious(Lion(.1))", lambda: O.Cautious(O.Lion(0.1, (0.8, 0.95))),
                      r_cautious(r_lion(0.1, (0.8, 0.95))), 5),
            Reference("Cautious(AdEMAMix(wd))", lambda: O.Cautious(O.AdEMAMix(0.1, beta3=0.9, weight_decay=0.2)),
                      r_cautious(r_ademamix(0.1, beta3=0.9), lambda x: f32(0.1) * f32(0.2) * x), 5),
            Reference("Cautious(chain(ClipGlobalNorm(1),AdamW))",
                      lambda: O.Cautious(O.chain(O.ClipGlobalNorm(1.0), O.AdamW(0.1, weight_decay=0.3))),
                      r_cautious(r_chain(r_clipnorm(1.0, 2), r_adamw(0.1)), lambda x: f32(0.1) * f32(0.3) * x), 5),
            # a decay that is not the last stage is masked with the rest
            Reference("Cautious(chain(WeightDecay(.3),Adam(.1)))",
                      lambda: O.Cautious(O.chain(O.WeightDecay(0.3), O.Adam(0.1))),
                      r_cautious(r_chain(r_weightdecay(0.3), r_adam(0.1))), 5)),
        stacked=(Case("Cautious(AdamW+schedule)", lambda: O.Cautious(O.AdamW(O.Linear(0.1, 0.01, 4),
                                                                                weight_decay=0.1))),
                 Case("Cautious(AccumGrad(2)+AdamW)", lambda: O.Cautious(O.chain(O.AccumGrad(2),
                                                                                 O.AdamW(0.1, weight_decay=0.1)))),
                 Case("Cautious(SkipNonFinite(AdamW))", lambda: O.Cautious(O.SkipNonFinite(O.AdamW(0.1,
                                                                                               weight_decay=0.1))))),
        converges=(Converges("Cautious(AdamW(1e-2))", lambda: O.Cautious(O.AdamW(1e-2, weight_decay=1e-3)),
                             0.01),                                                              # 1.8e-5
                   Converges("Cautious(Lion(3e-3))", lambda: O.Cautious(O.Lion(3e-3)), 0.01)),  # 6.2e-5
        dtypes=(Case("Cautious(AdamW)", lambda: O.Cautious(O.AdamW(weight_decay=0.1))),
                Case("Cautious(Lion)", lambda: O.Cautious(O.Lion()))),
        bfloat16=(Case("Cautious(AdamW)", lambda: O.Cautious(O.AdamW(0.1, weight_decay=0.1))),),
        complex_=(Case("Cautious(AdamW)", lambda: O.Cautious(O.AdamW(1e-2, weight_decay=1e-3))),),
        structural=(Bad("Cautious(3)", lambda: O.Cautious(3), TypeError,
                        r"Cautious: rule must be a rule \(it needs init and apply\), got 3; write "
                        r"Cautious\(AdamW\(1e-3\)\)"),
                    Bad("Cautious(MixedPrecision)", lambda: O.Cautious(O.MixedPrecision(O.Adam())), TypeError,
                        "Cautious: MixedPrecision must wrap Cautious")),
        adjust=((lambda: O.Cautious(O.AdamW(0.01, weight_decay=0.1)),
                 [{"lr": 0.001}, {"beta": (0.5, 0.9), "weight_decay": 0.0}]),),
        no_optax="optax 0.2.8 has no cautious masking",
        zero1=(Case("Cautious", lambda: O.Cautious(O.AdamW(0.01, weight_decay=0.1))),
               Case("CautiousChain", lambda: O.Cautious(O.chain(O.ClipGlobalNorm(0.5),
                                                                O.AdamW(0.01, weight_decay=0.1))))),
    ),
    RuleCases(
        O.Lamb, reduces_over_parameter=True, trust_ratio=True,
        stacked=(Case("Lamb(.1,wd)", lambda: O.Lamb(0.1, weight_decay=0.1)),),
        bad=(Bad("Lamb lr", lambda: O.Lamb(-0.1), ValueError, "Lamb: lr must be >= 0 and finite, got -0.1"),
             Bad("Lamb beta", lambda: O.Lamb(beta=(0.9, 1.0)), ValueError, r"Lamb: beta\[1\] must be in \[0, 1\)"),
             Bad("Lamb eps_root", lambda: O.Lamb(eps_root=-1e-8), ValueError, "Lamb: eps_root must be >= 0")),
        x64_optax=(Optax("Lamb()", lambda: O.Lamb(0.01), lambda: optax.lamb(0.01), defaults=True),
                   Optax("Lamb(all)", lambda: O.Lamb(0.02, beta=(0.8, 0.99), eps=1e-5, weight_decay=0.1, eps_root=1e-8),
                         lambda: optax.lamb(0.02, b1=0.8, b2=0.99, eps=1e-5, eps_root=1e-8, weight_decay=0.1))),
        adjust=((lambda: O.Lamb(0.01, weight_decay=0.1), [{"lr": 0.001}, {"beta": (0.5, 0.9), "weight_decay": 0.0}]),),
        zero1=(Case("Lamb", lambda: O.Lamb(0.01)),),
    ),
    RuleCases(
        O.Lars, reduces_over_parameter=True, trust_ratio=True,
        stacked=(Case("Lars(1,wd,nesterov)", lambda: O.Lars(1.0, weight_decay=0.1, trust_coefficient=0.02,
                                                             nesterov=True)),),
        bad=(Bad("Lars lr", lambda: O.Lars(lr=-1.0), ValueError, "Lars: lr must be >= 0 and finite, got -1.0"),
             Bad("Lars rho", lambda: O.Lars(1.0, rho=1.5), ValueError, r"Lars: rho must be in \[0, 1\]"),
             Bad("Lars trust", lambda: O.Lars(trust_coefficient=float("nan")), ValueError,
                 "Lars: trust_coefficient must be")),
        structural=(Bad("Lars nesterov", lambda: O.Lars(nesterov="no"), TypeError,
                        "Lars: nesterov must be True or False, got str"),),
        x64_optax=(Optax("Lars()", lambda: O.Lars(0.5), lambda: optax.lars(0.5), defaults=True),
                   Optax("Lars(all,nesterov)", lambda: O.Lars(2.0, rho=0.8, weight_decay=0.01, trust_coefficient=0.02,
                                                              eps=1e-3, nesterov=True),
                         lambda: optax.lars(2.0, weight_decay=0.01, trust_coefficient=0.02, eps=1e-3, momentum=0.8,
                                            nesterov=True))),
        adjust=((lambda: O.Lars(1.0), [{"lr": 0.1}, {"rho": 0.5, "trust_coefficient": 0.01, "eps": 1e-3}]),),
        zero1=(Case("Lars", lambda: O.Lars(1.0, weight_decay=0.01)),),
    ),
    RuleCases(
        O.ScheduleFreeAdamW, evaluates_at_average=True,
        stacked=(Case("ScheduleFreeAdamW(.1,wd,warmup)", lambda: O.ScheduleFreeAdamW(0.1, weight_decay=0.1,
                                                                                      warmup_steps=2)),),
        bad=(Bad("SF lr", lambda: O.ScheduleFreeAdamW(-0.1), ValueError,
                 "ScheduleFreeAdamW: lr must be >= 0 and finite"),
             Bad("SF beta1 0", lambda: O.ScheduleFreeAdamW(beta=(0.0, 0.999)), ValueError,
                 r"ScheduleFreeAdamW: beta\[0\] must be in \(0, 1\)"),
             Bad("SF warmup", lambda: O.ScheduleFreeAdamW(warmup_steps=-1), ValueError,
                 "ScheduleFreeAdamW: warmup_steps must"),
             Bad("SF power", lambda: O.ScheduleFreeAdamW(weight_lr_power="2"), TypeError,
                 "weight_lr_power must be a real")),
        x64_optax=(Optax("ScheduleFreeAdamW()", lambda: O.ScheduleFreeAdamW(),
                         lambda: optax.contrib.schedule_free_adamw(), defaults=True),
                   Optax("ScheduleFreeAdamW(all,warmup)",
                         lambda: O.ScheduleFreeAdamW(0.05, beta=(0.85, 0.99), eps=1e-6, weight_decay=0.1,
                                                     warmup_steps=5, weight_lr_power=1.5),
                         lambda: _sf_adamw_warmup64(0.05, warmup_steps=5, b1=0.85, b2=0.99, eps=1e-6,
                                                    weight_decay=0.1, weight_lr_power=1.5))),
        adjust=((lambda: O.ScheduleFreeAdamW(0.01, warmup_steps=2),
                 [{"lr": 0.001}, {"beta": (0.5, 0.9), "warmup_steps": 10.0, "weight_lr_power": 1.0,
                                  "weight_decay": 0.1}]),),
        zero1=(Case("ScheduleFreeAdamW", lambda: O.ScheduleFreeAdamW(0.01)),),
    ),
    RuleCases(
        O.Adafactor, reduces_over_parameter=True,
        stacked=(Case("Adafactor(factored,momentum,wd)", lambda: O.Adafactor(0.1, momentum=0.9, weight_decay=0.01,
                                                                              min_dim_size_to_factor=3)),
                 Case("Adafactor(unfactored)", lambda: O.Adafactor(0.1, factored=False))),
        adjust=((lambda: O.Adafactor(0.01, momentum=0.9, min_dim_size_to_factor=2),
                 [{"lr": 0.1}, {"decay_rate": 0.5, "momentum": 0.5, "weight_decay": 0.1, "clipping_threshold": 2.0,
                                "eps": 1e-20, "min_scale": 1e-2, "decay_offset": 0}]),),
        no_optax="compared with optax.adafactor in test_adafactor.py (float64, factored and unfactored: it needs "
                 "matrices and optax's decay computed in float64)",
        zero1=(Case("Adafactor", lambda: O.Adafactor(0.01)),
               Case("AdafactorFactored", lambda: O.Adafactor(0.01, min_dim_size_to_factor=8, momentum=0.9))),
    ),
    # Muon takes matrices only: no reference case (those run on vectors and scalars too); its own tests are in
    # test_rules.py section 5 and test_stacking.py::test_muon_stacked_equals_per_leaf.
    RuleCases(
        O.Muon, reduces_over_parameter=True,
        bad=(Bad("Muon rho", lambda: O.Muon(0.02, rho=2.0), ValueError, r"Muon: rho must be in \[0, 1\)"),),
        structural=(
            Bad("Muon steps -1", lambda: O.Muon(steps=-1), ValueError,
                r"Muon: steps must be >= 1, got -1 \(with no iteration the momentum is not orthogonalised\)"),
            Bad("Muon steps 0", lambda: O.Muon(steps=0), ValueError, "Muon: steps must be >= 1, got 0"),
            Bad("Muon steps 2.5", lambda: O.Muon(steps=2.5), TypeError,
                "Muon: steps must be an integer, got float 2.5"),
            Bad("Muon steps str", lambda: O.Muon(steps="5"), TypeError, "Muon: steps must be an integer, got str '5'"),
            Bad("Muon steps bool", lambda: O.Muon(steps=True), TypeError, "Muon: steps must be an integer, got bool"),
            Bad("Muon nesterov", lambda: O.Muon(nesterov="no"), TypeError,
                "Muon: nesterov must be True or False, got str 'no'"),
            Bad("Muon adaptive", lambda: O.Muon(adaptive=1), TypeError,
                "Muon: adaptive must be True or False, got int 1"),
            Bad("Muon ns_coeffs preset", lambda: O.Muon(ns_coeffs="muon"), ValueError,
                r'Muon: ns_coeffs must be "standard", "dion", "polar_express", a triple \(a, b, c\) or a tuple of '
                r"triples \(one per step\), got 'muon'"),
            Bad("Muon ns_coeffs pair", lambda: O.Muon(ns_coeffs=(3.4, -4.7)), TypeError,
                r"Muon: ns_coeffs must be .* got an array of shape \(2,\)"),
            Bad("Muon ns_coeffs ragged", lambda: O.Muon(ns_coeffs=((1.0, 2.0, 3.0), (1.0, 2.0))), TypeError,
                r"Muon: ns_coeffs must be .*, got tuple \(\(1.0, 2.0, 3.0\), \(1.0, 2.0\)\)"),
            Bad("Muon ns_coeffs nan", lambda: O.Muon(ns_coeffs=(3.4, float("nan"), 2.0)), ValueError,
                "Muon: ns_coeffs must be finite, got"),
            Bad("Muon ns_coeffs steps", lambda: O.Muon(ns_coeffs="dion", steps=4), ValueError,
                r"Muon: steps=4 disagrees with the 5 per-step ns_coeffs .* give steps=5"),
            Bad("Muon per-step steps", lambda: O.Muon(ns_coeffs=[(3.4, -4.7, 2.0)] * 2, steps=5), ValueError,
                "Muon: steps=5 disagrees with the 2 per-step ns_coeffs"),
            Bad("Muon preconditioning", lambda: O.Muon(preconditioning="newton"), ValueError,
                "Muon: preconditioning must be one of 'frobenius', 'spectral', 'aol', 'schatten', got 'newton'"),
            Bad("Muon preconditioning type", lambda: O.Muon(preconditioning=None), TypeError,
                "Muon: preconditioning must be one of 'frobenius', 'spectral', 'aol', 'schatten', got NoneType "
                "None")),
        matrices=(Case("Muon()", lambda: O.Muon(0.02)),
                  Case("Muon(polar_express,aol)", lambda: O.Muon(0.02, ns_coeffs="polar_express",
                                                                   preconditioning="aol")),
                  Case("Muon(adaptive,schatten)", lambda: O.Muon(0.02, adaptive=True, preconditioning="schatten")),
                  Case("Muon(Linear,dion,spectral,wd)", lambda: O.Muon(O.Linear(0.02, 0.01, 4), ns_coeffs="dion",
                                                                         preconditioning="spectral",
                                                                         weight_decay=0.1))),
        adjust=((lambda: O.Muon(0.02, consistent_rms=0.2),
                 [{"lr": 0.001}, {"rho": 0.5, "eps": 1e-6, "weight_decay": 0.1, "consistent_rms": 0.3}]),),
        no_optax="compared with optax.contrib.muon in test_rules.py section 5 (matrices only, with its axis "
                 "arguments)",
        zero1=(Case("Muon", lambda: O.Muon(0.02)),
               Case("MuonAdaptive", lambda: O.Muon(0.02, adaptive=True, nesterov=False, weight_decay=0.1)),
               Case("MuonPolarAol", lambda: O.Muon(0.02, ns_coeffs="polar_express", preconditioning="aol")),
               Case("MuonDionSpectral", lambda: O.Muon(0.02, ns_coeffs="dion", preconditioning="spectral"))),
    ),
    # NorMuon takes matrices only, like Muon: compared with its numpy reference (`r_normuon`) in test_rules.py
    # section 5, stacked in test_stacking.py (`matrices`).
    RuleCases(
        O.NorMuon, O.NorMuon(0.02, 0.95, 0.95, 1e-8, 0.0, None, True, None, 0, None, None, "standard", "frobenius"),
        has_lr=True, reduces_over_parameter=True,
        matrices=(Case("NorMuon()", lambda: O.NorMuon(0.02)),
                  Case("NorMuon(Linear,all)", lambda: O.NorMuon(O.Linear(0.05, 0.01, 4), rho=0.8, beta2=0.9,
                                                                eps=1e-6, weight_decay=0.1, consistent_rms=0.2,
                                                                nesterov=False, steps=3)),
                  Case("NorMuon(polar_express,schatten)", lambda: O.NorMuon(0.02, ns_coeffs="polar_express",
                                                                            preconditioning="schatten"))),
        keywords=((lambda: O.NorMuon(lr=0.01, rho=0.9, beta2=0.8, eps=1e-6, weight_decay=0.1),
                   lambda: O.NorMuon(0.01, 0.9, 0.8, 1e-6, 0.1)),),
        bad=(Bad("NorMuon beta2", lambda: O.NorMuon(beta2=1.0), ValueError,
                 r"NorMuon: beta2 must be in \[0, 1\)"),
             Bad("NorMuon rho", lambda: O.NorMuon(rho=-0.1), ValueError, r"NorMuon: rho must be in \[0, 1\)"),
             Bad("NorMuon eps", lambda: O.NorMuon(eps=-1.0), ValueError, "NorMuon: eps must be >= 0")),
        structural=(
            Bad("NorMuon steps 0", lambda: O.NorMuon(steps=0), ValueError, "NorMuon: steps must be >= 1, got 0"),
            Bad("NorMuon ns_coeffs", lambda: O.NorMuon(ns_coeffs="quintic"), ValueError,
                "NorMuon: ns_coeffs must be .*, got 'quintic'"),
            Bad("NorMuon ns_coeffs steps", lambda: O.NorMuon(ns_coeffs=[(3.4, -4.7, 2.0)] * 2, steps=3),
                ValueError, "NorMuon: steps=3 disagrees with the 2 per-step ns_coeffs"),
            Bad("NorMuon preconditioning", lambda: O.NorMuon(preconditioning="AOL"), ValueError,
                "NorMuon: preconditioning must be one of 'frobenius', 'spectral', 'aol', 'schatten', got 'AOL'"),
            Bad("NorMuon nesterov", lambda: O.NorMuon(nesterov="no"), TypeError,
                "NorMuon: nesterov must be True or False, got str 'no'"),
            Bad("NorMuon axes", lambda: O.NorMuon(reduction_axis="0"), TypeError,
                "NorMuon: reduction_axis must be an int or a tuple of ints")),
        adjust=((lambda: O.NorMuon(0.02, consistent_rms=0.2),
                 [{"lr": 0.001}, {"rho": 0.5, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.1,
                                  "consistent_rms": 0.3}]),),
        no_optax="optax 0.2.8 has no NorMuon (optax PRs #1612 and #1651 propose one, unmerged): compared with a "
                 "float64 numpy reference from the paper and its code (r_normuon) in test_rules.py section 5",
        zero1=(Case("NorMuon", lambda: O.NorMuon(0.02)),
               Case("NorMuonWd", lambda: O.NorMuon(0.02, weight_decay=0.1, nesterov=False, ns_coeffs="dion"))),
    ),
    # Whole-model rules (their sums run over every parameter, like ClipGlobalNorm's norm): a reference case is a
    # model of one parameter; `stacked` runs them over the stacking test's model (None gradients, a frozen
    # member), `x64_optax` on its tied model (optax given the weight once, with the summed gradient).
    RuleCases(
        O.Prodigy, O.Prodigy(1.0, (0.9, 0.999), None, 1e-8, 1e-6, 1.0, 0.0, False), has_lr=True,
        reduces_over_parameter=True,
        references=(
            Reference("Prodigy()", lambda: O.Prodigy(), r_prodigy(), 8),
            Reference("Prodigy(d0=.1,all)", lambda: O.Prodigy(0.5, beta=(0.8, 0.99), beta3=0.9, eps=1e-4,
                                                              estim_lr0=0.1, estim_lr_coef=2.0, weight_decay=0.1),
                      r_prodigy(0.5, (0.8, 0.99), 0.9, 1e-4, 0.1, 2.0, 0.1), 8),
            Reference("Prodigy(d0=.1,safeguard)", lambda: O.Prodigy(estim_lr0=0.1, safeguard_warmup=True),
                      r_prodigy(estim_lr0=0.1, safeguard_warmup=True), 8)),
        converges=(Converges("Prodigy()", lambda: O.Prodigy(), 0.01),                          # 7.3e-4
                   Converges("Prodigy(safeguard)", lambda: O.Prodigy(safeguard_warmup=True), 0.01)),  # 8.5e-12
        stacked=(Case("Prodigy(Linear,d0=.01,wd)", lambda: O.Prodigy(O.Linear(1.0, 0.5, 4), estim_lr0=0.01,
                                                                     weight_decay=0.1)),),
        dtypes=(Case("Prodigy", lambda: O.Prodigy(estim_lr0=0.01)),),
        keywords=((lambda: O.Prodigy(lr=0.5, beta3=0.9, safeguard_warmup=True),
                   lambda: O.Prodigy(0.5, (0.9, 0.999), 0.9, safeguard_warmup=True)),),
        int_hyperparameters=(IntHyper("Prodigy(estim_lr_coef=2)", lambda: O.Prodigy(estim_lr_coef=2),
                                      "estim_lr_coef"),),
        bad=(Bad("Prodigy estim_lr0", lambda: O.Prodigy(estim_lr0=0), ValueError,
                 "Prodigy: estim_lr0 must be > 0 and finite, got 0.0"),
             Bad("Prodigy beta3", lambda: O.Prodigy(beta3=1.0), ValueError,
                 r"Prodigy: beta3 must be in \[0, 1\) and finite, got 1.0")),
        structural=(Bad("Prodigy safeguard_warmup", lambda: O.Prodigy(safeguard_warmup="no"), TypeError,
                        "Prodigy: safeguard_warmup must be True or False, got str 'no'"),),
        x64_optax=(Optax("Prodigy()", lambda: O.Prodigy(), lambda: optax.contrib.prodigy(), defaults=True),
                   Optax("Prodigy(all)", lambda: O.Prodigy(0.5, beta=(0.8, 0.99), beta3=0.9, eps=1e-4, estim_lr0=1e-3,
                                                           estim_lr_coef=2.0, weight_decay=0.1, safeguard_warmup=True),
                         lambda: optax.contrib.prodigy(0.5, (0.8, 0.99), 0.9, 1e-4, 1e-3, 2.0, 0.1, True))),
        adjust=((lambda: O.Prodigy(estim_lr0=0.01, beta3=0.9),
                 [{"lr": 0.5}, {"beta": (0.8, 0.99), "beta3": 0.5, "eps": 1e-6, "estim_lr0": 0.1,
                                "estim_lr_coef": 2.0, "weight_decay": 0.1}]),),
        zero1=(Case("Prodigy", lambda: O.Prodigy(estim_lr0=1e-2, weight_decay=0.01)),),
    ),
    RuleCases(
        O.DoG, O.DoG(1.0, 1e-6, 1e-8, None), has_lr=True, reduces_over_parameter=True,
        references=(
            Reference("DoG()", lambda: O.DoG(), r_dog(), 8),
            Reference("DoG(reps_rel=.1,eps)", lambda: O.DoG(0.5, reps_rel=0.1, eps=1e-2), r_dog(0.5, 0.1, 1e-2), 8),
            Reference("DoG(init_lr=.1)", lambda: O.DoG(init_learning_rate=0.1), r_dog(init_learning_rate=0.1), 8)),
        converges=(Converges("DoG()", lambda: O.DoG(), 0.01),),                               # 8.8e-13
        stacked=(Case("DoG(Linear,reps_rel=.01)", lambda: O.DoG(O.Linear(1.0, 0.5, 4), reps_rel=0.01)),),
        dtypes=(Case("DoG", lambda: O.DoG(reps_rel=0.01)),),
        keywords=((lambda: O.DoG(lr=0.5, init_learning_rate=0.1), lambda: O.DoG(0.5, 1e-6, 1e-8, 0.1)),),
        int_hyperparameters=(IntHyper("DoG(init_learning_rate=1)", lambda: O.DoG(init_learning_rate=1),
                                      "init_learning_rate"),),
        bad=(Bad("DoG reps_rel", lambda: O.DoG(reps_rel=-1.0), ValueError,
                 "DoG: reps_rel must be >= 0 and finite, got -1.0"),
             Bad("DoG init_learning_rate", lambda: O.DoG(init_learning_rate="1"), TypeError,
                 "DoG: init_learning_rate must be a real number")),
        x64_optax=(Optax("DoG()", lambda: O.DoG(), lambda: optax.contrib.dog(), defaults=True),
                   Optax("DoG(all)", lambda: O.DoG(0.5, reps_rel=1e-3, eps=1e-4),
                         lambda: optax.contrib.dog(0.5, ("heuristic", 1e-3), 1e-4)),
                   Optax("DoG(init_lr)", lambda: O.DoG(init_learning_rate=0.05),
                         lambda: optax.contrib.dog(init_step=("learning_rate", 0.05)))),
        adjust=((lambda: O.DoG(init_learning_rate=0.1), [{"lr": 0.5}, {"init_learning_rate": 0.2, "eps": 1e-6}]),
                (lambda: O.DoG(), [{"reps_rel": 1e-3, "lr": 2.0}])),
        zero1=(Case("DoG", lambda: O.DoG(reps_rel=1e-2)),),
    ),
    # Rules with no case of the tables above yet; each has its own test file (test_average.py,
    # test_global_rules.py, test_soap.py, test_state.py) and its registry facts here.
    RuleCases(
        O.EMA,
        no_optax="compared with optax.ema in test_average.py (fed the parameters after each step)",
        zero1=(Case("EMA", lambda: O.EMA(O.Adam(0.01), decay=0.9)),),
        kernel=(Kernel("EMA(AdamW)", lambda: O.EMA(O.AdamW(0.01, weight_decay=0.1), decay=0.9)),
                Kernel("EMA(SkipNonFinite(chain(ClipGlobalNorm, Lion, Scale)))", lambda: O.EMA(O.SkipNonFinite(
                    O.chain(O.ClipGlobalNorm(5.0), O.Lion(0.01), O.Scale(2.0))), decay=0.5)),
                Kernel("EMA(Descent)", lambda: O.EMA(O.Descent(0.1), decay=0.7)),
                Kernel("EMA(AdaBelief)", lambda: O.EMA(O.AdaBelief(0.01), decay=0.9)),
                Kernel("EMA(ADOPT)", lambda: O.EMA(O.ADOPT(0.01), decay=0.9))),
    ),
    RuleCases(
        O.SkipLargeUpdates, reduces_over_parameter=True,
        no_optax="optax.skip_large_updates skips above a fixed squared norm, SkipLargeUpdates σ deviations above "
                 "the running norm: no counterpart",
        zero1=(Case("SkipLargeUpdates", lambda: O.SkipLargeUpdates(O.Adam(0.01), warmup=1)),),
        # sigma 0.5 after one norm: some steps are skipped (the norms grow with t), some not
        kernel=(Kernel("SkipLargeUpdates(Adam)", lambda: O.SkipLargeUpdates(O.Adam(0.01), sigma=0.5, warmup=1)),),
    ),
    RuleCases(
        O.SOAP, reduces_over_parameter=True,
        no_optax="optax 0.2.8 has no SOAP: test_soap.py compares with the authors' PyTorch soap.py and a numpy "
                 "reference",
        zero1=(Case("SOAP", lambda: O.SOAP(0.01, precondition_frequency=1)),),
    ),
    # Shampoo: the reference cases run on a vector, which takes the graft's step (no factor); the stacking test
    # runs them on matrices too (blocks, roots, grafting), and test_shampoo.py compares matrices with the same
    # numpy reference and with precondition-opt's distributed_shampoo (a stored fixture).
    RuleCases(
        O.Shampoo, O.Shampoo(1e-3, (0.9, 0.999), 1024, 100, 101, "adam", 1e-6, 0.0, 1e-10, True), has_lr=True,
        reduces_over_parameter=True,
        references=(
            Reference("Shampoo()", lambda: O.Shampoo(), r_shampoo(), 5),
            Reference("Shampoo(rmsprop,blocks)", lambda: O.Shampoo(
                0.05, (0.8, 0.95), 2, 2, 1, "rmsprop", 1e-2, 0.1, 1e-8), r_shampoo(
                0.05, (0.8, 0.95), 2, 2, 1, "rmsprop", 1e-2, 0.1, 1e-8), 8),
            Reference("Shampoo(sgd,no nesterov)", lambda: O.Shampoo(
                0.02, (0.5, 0.9), 3, 3, 0, "sgd", 1e-2, nesterov=False), r_shampoo(
                0.02, (0.5, 0.9), 3, 3, 0, "sgd", 1e-2, nesterov=False), 8),
            Reference("Shampoo(adagrad)", lambda: O.Shampoo(0.05, (0.7, 0.9), 4, 1, 2, "adagrad", 1e-2),
                      r_shampoo(0.05, (0.7, 0.9), 4, 1, 2, "adagrad", 1e-2), 8)),
        stacked=(Case("Shampoo+schedule", lambda: O.Shampoo(O.Linear(0.05, 0.01, 4), precondition_every=2,
                                                            start_preconditioning_step=1, matrix_eps=1e-2)),),
        converges=(Converges("Shampoo(0.05)", lambda: O.Shampoo(0.05, precondition_every=5,
                                                                start_preconditioning_step=6), 2e-3),),  # 4.5e-4
        dtypes=(Case("Shampoo", lambda: O.Shampoo(0.01, precondition_every=1, start_preconditioning_step=0)),),
        keywords=((lambda: O.Shampoo(nesterov=False, diagonal_eps=1e-8, weight_decay=0.1, matrix_eps=1e-4,
                                     graft="sgd", start_preconditioning_step=3, precondition_every=2, block_size=8,
                                     beta=(0.8, 0.9), lr=0.2),
                   lambda: O.Shampoo(0.2, (0.8, 0.9), 8, 2, 3, "sgd", 1e-4, 0.1, 1e-8, False)),),
        bad=(Bad("Shampoo beta2 = 1", lambda: O.Shampoo(beta=(0.9, 1.0)), ValueError,
                 r"Shampoo: beta\[1\] must be in \[0, 1\) and finite, got 1.0"),
             Bad("Shampoo matrix_eps", lambda: O.Shampoo(matrix_eps=-1.0), ValueError,
                 "Shampoo: matrix_eps must be >= 0 and finite, got -1.0"),
             Bad("Shampoo precondition_every 0", lambda: O.Shampoo(precondition_every=0), ValueError,
                 "Shampoo: precondition_every must be an integer >= 1, got 0"),
             Bad("Shampoo start -1", lambda: O.Shampoo(start_preconditioning_step=-1), ValueError,
                 "Shampoo: start_preconditioning_step must be an integer >= 0, got -1")),
        structural=(
            Bad("Shampoo block_size 0", lambda: O.Shampoo(block_size=0), ValueError,
                r"Shampoo: block_size must be >= 1, got 0 \(it is the longest side of a block\)"),
            Bad("Shampoo block_size 2.5", lambda: O.Shampoo(block_size=2.5), TypeError,
                "Shampoo: block_size must be an integer, got float 2.5"),
            Bad("Shampoo graft lion", lambda: O.Shampoo(graft="lion"), ValueError,
                "Shampoo: graft must be one of 'adam', 'rmsprop', 'adagrad', 'sgd', got 'lion'"),
            Bad("Shampoo graft 1", lambda: O.Shampoo(graft=1), TypeError, "Shampoo: graft must be a string, got int 1"),
            Bad("Shampoo nesterov", lambda: O.Shampoo(nesterov="no"), TypeError,
                "Shampoo: nesterov must be True or False, got str 'no'")),
        adjust=((lambda: O.Shampoo(0.01, precondition_every=2, start_preconditioning_step=1),
                 [{"lr": 0.001}, {"beta": (0.5, 0.9), "matrix_eps": 1e-4, "weight_decay": 0.1, "diagonal_eps": 1e-8,
                                  "precondition_every": 3, "start_preconditioning_step": 5}]),),
        no_optax="optax 0.2.8 has no Shampoo: test_shampoo.py compares with precondition-opt's distributed_shampoo "
                 "(a stored fixture) and the numpy reference on matrices",
        # matrix_eps 1e-2: the roots of the first statistics (one gradient) are ill-conditioned, and the sharded
        # program rounds the statistics otherwise than the unsharded one (with 1e-3, one number of 1153 differed
        # by 1.2e-4 relative on an AMD EPYC, none on the CPU the case was written on)
        zero1=(Case("Shampoo", lambda: O.Shampoo(0.01, block_size=4, precondition_every=2,
                                                 start_preconditioning_step=1, matrix_eps=1e-2)),),
    ),
    # Kron: the reference cases run on a vector (a diagonal factor) and, in the stacking test, on matrices too
    # (triangular factors); test_kron.py compares matrices, 3-axis arrays and scalars with the same numpy
    # reference and with psgd-jax's kron (a stored fixture).
    RuleCases(
        O.Kron, O.Kron(1e-3, 0.9, 0.0, 1.0, 8192, 0.1, 0), has_lr=True, reduces_over_parameter=True,
        references=(
            Reference("Kron()", lambda: O.Kron(), r_kron(), 5),
            Reference("Kron(.05,.5,.1,p=.5,plr=.3,seed=3)", lambda: O.Kron(0.05, 0.5, 0.1, 0.5, 8192, 0.3, 3),
                      r_kron(0.05, 0.5, 0.1, 0.5, 8192, 0.3, 3), 8),
            Reference("Kron(b1=0)", lambda: O.Kron(0.02, 0.0, precond_lr=0.2), r_kron(0.02, 0.0, precond_lr=0.2),
                      8)),
        stacked=(Case("Kron+schedule", lambda: O.Kron(O.Linear(0.05, 0.01, 4))),),
        converges=(Converges("Kron(0.02)", lambda: O.Kron(0.02), 5e-3),),                    # 1.05e-3
        dtypes=(Case("Kron", lambda: O.Kron(0.01)),),
        keywords=((lambda: O.Kron(seed=3, precond_lr=0.2, max_size_triangular=4,
                                  preconditioner_update_probability=0.5, weight_decay=0.1, b1=0.8, lr=0.2),
                   lambda: O.Kron(0.2, 0.8, 0.1, 0.5, 4, 0.2, 3)),),
        bad=(Bad("Kron b1 = 1", lambda: O.Kron(b1=1.0), ValueError, r"Kron: b1 must be in \[0, 1\)"),
             Bad("Kron probability", lambda: O.Kron(preconditioner_update_probability=1.5), ValueError,
                 r"Kron: preconditioner_update_probability must be in \[0, 1\]"),
             Bad("Kron precond_lr", lambda: O.Kron(precond_lr=-0.1), ValueError,
                 "Kron: precond_lr must be >= 0 and finite, got -0.1")),
        structural=(
            Bad("Kron max_size_triangular -1", lambda: O.Kron(max_size_triangular=-1), ValueError,
                r"Kron: max_size_triangular must be >= 0, got -1 \(it is the longest triangular axis\)"),
            Bad("Kron max_size_triangular 2.5", lambda: O.Kron(max_size_triangular=2.5), TypeError,
                "Kron: max_size_triangular must be an integer, got float 2.5"),
            Bad("Kron seed -1", lambda: O.Kron(seed=-1), ValueError, "Kron: seed must be >= 0, got -1"),
            Bad("Kron seed 1.5", lambda: O.Kron(seed=1.5), TypeError, "Kron: seed must be an integer, got float 1.5")),
        adjust=((lambda: O.Kron(0.01), [{"lr": 0.001}, {"b1": 0.5, "weight_decay": 0.1, "precond_lr": 0.2,
                                                       "preconditioner_update_probability": 0.5}]),),
        no_optax="optax 0.2.8 has no PSGD: test_kron.py compares with psgd-jax's kron (a stored fixture) and the "
                 "numpy reference on matrices",
        zero1=(Case("Kron", lambda: O.Kron(0.01)),),
    ),
    RuleCases(
        O.Scale,
        no_optax="a constant factor: compared with optax.chain(optax.adam, optax.scale) in test_state.py",
        zero1=(Case("Scale", lambda: O.chain(O.Adam(0.01), O.Scale(0.5))),),
        kernel=(Kernel("chain(Adam, Scale)", lambda: O.chain(O.Adam(0.01), O.Scale(0.5))),),
    ),
]
BY_CLASS = {r.cls: r for r in RULES}


def reduces(rule: Any) -> bool:
    """Whether `rule`'s step depends on a whole parameter: its class says so, or a rule inside it does."""
    entry = BY_CLASS.get(type(rule))
    if entry is not None and entry.reduces_over_parameter:
        return True
    inner = [getattr(rule, f) for f in inner_fields(rule)]
    return any(reduces(r) for v in inner for r in (v if isinstance(v, tuple) else (v,)))


def classes_in(rule: Any) -> set:
    """The classes of `rule` and of the rules inside it (chains, wrappers)."""
    inner = [getattr(rule, f) for f in inner_fields(rule)]
    return {type(rule)}.union(*(classes_in(r) for v in inner for r in (v if isinstance(v, tuple) else (v,))))


def table(field: str, where: Callable[[RuleCases], bool] = lambda r: True) -> list:
    """The entries of `field` of every rule (for which `where` holds), in the order of `RULES`."""
    return [c for r in RULES if where(r) for c in getattr(r, field)]
