"""optim: a tie-aware, functional optimiser library for JAX pytrees.

>>> import jax, jax.numpy as jnp, optim
>>> w = jnp.array([1.0, 2.0])
>>> model = {"emb": w, "head": w}            # one array in two places: one parameter
>>> state = optim.setup(optim.Descent(0.1), model)
>>> grads = {"emb": jnp.ones(2), "head": jnp.ones(2)}
>>> state, model = optim.update(state, model, grads)
>>> model["emb"], model["emb"] is model["head"]
(Array([0.8, 1.8], dtype=float32), True)
"""

from . import _fused  # noqa: F401  (registers the fused CPU kernel with the engine: optim._strategies)
from ._adafactor import Adafactor
from ._adjust import adjust, freeze, thaw
from ._average import EMA, averaged
from ._checkpoint import load, save
from ._optax import WholeTreeError, from_optax, to_optax, with_extra_args
from ._destructure import destructure, trainables
from ._microbatch import microbatch
from ._layerwise import Lamb, Lars, Muon
from ._rules import (
    AdaBelief, AdaDelta, AdaGrad, AdaMax, Adam, AdamW, AMSGrad, ClipGrad, ClipNorm, Descent, Lion, Momentum, NAdam,
    Nesterov, OAdam, RAdam, RMSProp, Rprop, Scale, SignDecay, WeightDecay,
)
from ._schedule_free import ScheduleFreeAdamW
from ._schedules import (
    WSD, Constant, Cosine, Exponential, InvSqrt, Join, Linear, Piecewise, Polynomial, Schedule, warmup_cosine,
)
from ._setup import by_path, setup
from ._state import Layout, Leaf, PathError, State
from ._state_dict import load_state_dict, state_dict
from ._step import Gated, Replace, Rule, apply_all, apply_step
from ._surgery import donatable, graft, reset, retie, subtree
from ._update import global_norm, tie_grads, update
from ._wrappers import (
    AccumGrad, ClipGlobalNorm, MixedPrecision, OptimiserChain, SkipLargeUpdates, SkipNonFinite, chain,
)

__version__ = "0.1.0"

__all__ = [
    "setup", "by_path", "update", "tie_grads", "save", "load", "from_optax", "to_optax", "with_extra_args",
    "WholeTreeError",
    "state_dict", "load_state_dict",
    "adjust", "freeze", "thaw", "reset", "retie", "donatable", "subtree", "graft", "trainables",
    "destructure", "microbatch", "EMA", "averaged",
    "State", "Leaf", "Layout", "PathError", "Rule", "Gated", "Replace", "apply_step", "apply_all",
    "ClipGlobalNorm", "SkipNonFinite", "SkipLargeUpdates", "Muon", "global_norm",
    "Schedule", "Constant", "Linear", "Cosine", "Piecewise", "Join", "warmup_cosine", "WSD", "InvSqrt", "Exponential",
    "Polynomial",
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "Lion", "WeightDecay", "SignDecay", "ClipGrad",
    "ClipNorm", "Scale", "Adafactor", "Lamb", "Lars", "ScheduleFreeAdamW", "OptimiserChain", "chain", "AccumGrad",
    "MixedPrecision",
]
