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

from ._adjust import adjust, freeze, thaw
from ._destructure import destructure, trainables
from ._rules import (
    AccumGrad, AdaBelief, AdaDelta, AdaGrad, AdaMax, Adam, AdamW, AMSGrad, ClipGrad, ClipNorm, Descent, Gated,
    Lion, MixedPrecision, Momentum, NAdam, Nesterov, OAdam, OptimiserChain, RAdam, Replace, RMSProp, Rprop, Rule,
    SignDecay, WeightDecay, apply_step, chain,
)
from ._state import Layout, Leaf, PathError, State, setup
from ._update import update

__version__ = "0.1.0"

__all__ = [
    "setup", "update", "adjust", "freeze", "thaw", "trainables", "destructure",
    "State", "Leaf", "Layout", "PathError", "Rule", "Gated", "Replace", "apply_step",
    "Descent", "Momentum", "Nesterov", "Rprop", "RMSProp", "Adam", "RAdam", "AdaMax", "OAdam", "AdaGrad",
    "AdaDelta", "AMSGrad", "NAdam", "AdamW", "AdaBelief", "Lion", "WeightDecay", "SignDecay", "ClipGrad",
    "ClipNorm", "OptimiserChain", "chain", "AccumGrad", "MixedPrecision",
]
