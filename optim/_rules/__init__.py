"""The rules: the protocol (`init` / `apply`), hyperparameters and schedules, the per-leaf formulas by family,
and the rules made of rules (chains, wrappers, EMA).

Per-leaf rules are pure `init(x) -> state` and `apply(state, x, dx, *dxs) -> (state, step)` over one parameter.

The new parameter is `x - step` (the protocol is in `protocol.py`; the contracts a rule's fields declare, in
`fields.py`, are checked by `hyper.py`). Formulas and defaults follow Optimisers.jl v0.4 (Lion follows its
paper): `sgd.py`, `adaptive.py`, `adam.py`, `transforms.py`, with the moments' helpers and storage in
`moments.py` and `quantized.py` (8-bit and 4-bit moments). ADOPT is in `adopt.py`, AdEMAMix in `ademamix.py`,
MARS in `mars.py`, Muon and NorMuon in `muon.py`, Lamb and Lars in `layerwise.py`, SOAP in `soap.py`, Shampoo
in `shampoo.py`, Kron in `kron.py` (the matrix rules split a stack's members across a mesh's devices with
`split.py`), Adafactor in `adafactor.py`, ScheduleFreeAdamW in `schedule_free.py`, the
whole-model learning-rate-free Prodigy and DoG in `lr_free.py` (they follow optax); schedules in `schedules.py`;
rules made of rules in `wrappers.py`, `average.py` (EMA), `cautious.py` and `rounding.py` (stochastic rounding).
Notation in the docstrings: `g` is the gradient, `η` the learning rate, `t` the step number (1 on the first
step), `bt` the products `(∏β₁, ∏β₂)` of the decay rates of the steps taken, this one's included (`(β₁ᵗ, β₂ᵗ)`
for constant β; `(1, 1)` before the first step), `m̂ = m / (1 - bt₁)` and `v̂ = v / (1 - bt₂)`: exact also where
β changes (a schedule, `adjust`), where `1 - ∏β` is the weight the moment's average has put on gradients.
Hyperparameters are numbers, arrays or schedules (`Hyper`); ranges are checked when a rule is built and when
`adjust` changes them.

Gradients reach `apply` already summed over a tie group, cast to the parameter's dtype and, for complex
parameters, conjugated: JAX's gradient of a real loss w.r.t. a complex `w` is the conjugate of the steepest
descent direction, so after conjugation `x - η g` descends, as in Optimisers.jl and PyTorch. Rules compute in
the parameter's real dtype but at least float32 (`protocol.compute_dtype`); states keep their storage dtype.

States are named tuples (`AdamState(mu, nu, bt)`: `state["w"].state.mu`), which index like the plain tuples
of earlier versions (files written by `optim.save` then still load). Moment storage dtypes (`mu_dtype`,
`nu_dtype`) are described in `optim._rules.moments`.
"""
