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

from ._rules.adafactor import Adafactor
from ._core.adjust import adjust, freeze, thaw
from ._core.average import averaged
from ._rules.average import EMA
from ._io.checkpoint import load, save
from ._interop.optax import WholeTreeError, from_optax, with_extra_args
from ._interop.to_optax import to_optax
from ._core.destructure import destructure, trainables
from ._core.microbatch import microbatch
from ._rules.layerwise import Lamb, Lars
from ._rules.muon import Muon, NorMuon
from ._rules.soap import SOAP
from ._rules.shampoo import Shampoo
from ._rules.kron import Kron
from ._rules.lr_free import DoG, Prodigy
from ._rules.adopt import ADOPT
from ._rules.mars import MARS
from ._rules.ademamix import AdEMAMix
from ._rules.cautious import Cautious
from ._rules.adam import AdaBelief, AdaMax, Adam, AdamW, AMSGrad, NAdam, OAdam, RAdam
from ._rules.adaptive import AdaDelta, AdaGrad, RMSProp
from ._rules.transforms import ClipGrad, ClipNorm, Scale, SignDecay, WeightDecay
from ._rules.sgd import Descent, Lion, Momentum, Nesterov, Rprop
from ._rules.schedule_free import ScheduleFreeAdamW
from ._rules.schedules import (
    WSD, Constant, Cosine, Exponential, InvSqrt, Join, Linear, Piecewise, Polynomial, Schedule, warmup_cosine,
)
from ._core.setup import by_path, setup
from ._core.footprint import state_bytes
from ._core.layout import Layout, PathError
from ._core.state import Leaf, State
from ._rules.quantized import Quantized, q4, q8
from ._io.state_dict import load_state_dict, state_dict
from ._rules.protocol import Gated, Replace, Rule, apply_all, apply_step
from ._rules import fields
from ._rules.rounding import StochasticRounding
from ._core.surgery import donatable, graft, reset, retie, subtree
from ._core.update import global_norm, tie_grads, update
from ._info import print_info
from ._rules.wrappers import (
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
    "fields",
    "ClipGlobalNorm", "SkipNonFinite", "SkipLargeUpdates", "Cautious", "Muon", "NorMuon", "SOAP", "Shampoo", "Kron",
    "global_norm",
    "Schedule", "Constant", "Linear", "Cosine", "Piecewise", "Join", "warmup_cosine", "WSD", "InvSqrt", "Exponential",
    "Polynomial",
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "ADOPT", "AdEMAMix", "MARS", "Lion", "WeightDecay",
    "SignDecay",
    "ClipGrad", "ClipNorm", "Scale", "Adafactor", "Lamb", "Lars", "ScheduleFreeAdamW", "Prodigy", "DoG",
    "OptimiserChain", "chain", "AccumGrad", "MixedPrecision", "StochasticRounding",
    "print_info",
    "Quantized", "q8", "q4", "state_bytes",
]
