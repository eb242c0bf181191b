"""float64 numpy references of the rules, one `r_*` per formula, for `rule_cases.py`.

Each is written from the rule's definition (Optimisers.jl v0.4's `src/rules.jl`; Lion and ADOPT from their
papers and optax), independently of optim's code. A reference is `Ref(init(x) -> state, apply(state, x, g) ->
(state, delta))`, and `x <- x - delta`. Hyperparameters are rounded to float32 first (`f32`), as Optimisers.jl
casts them to the parameter's eltype, and the rest is computed in float64.
"""

from __future__ import annotations

import math

import numpy as np


def f32(v):
    """A hyperparameter as float32 sees it, in float64 (Optimisers.jl casts hyperparameters to eltype(x))."""
    if isinstance(v, tuple):
        return tuple(f32(u) for u in v)
    return float(np.float32(v))



class Ref:
    def __init__(self, init, apply):
        self.init, self.apply = init, apply


def r_descent(lr=0.1):
    lr = f32(lr)
    return Ref(lambda x: None, lambda s, x, g: (s, lr * g))


def r_momentum(lr=0.01, rho=0.9):
    lr, rho = f32(lr), f32(rho)

    def apply(v, x, g):
        v = rho * v + lr * g
        return v, v
    return Ref(np.zeros_like, apply)


def r_nesterov(lr=0.001, rho=0.9):
    lr, rho = f32(lr), f32(rho)

    def apply(v, x, g):
        delta = -rho ** 2 * v + (1 + rho) * lr * g
        return rho * v - lr * g, delta
    return Ref(np.zeros_like, apply)


def r_rprop(lr=1e-3, ell=(0.5, 1.2), gamma=(1e-6, 50.0)):
    lr, (lo, hi), (gmin, gmax) = f32(lr), f32(ell), f32(gamma)

    def apply(s, x, g):
        gp, eta = s
        eta, gp = eta.copy(), gp.copy()
        for i in range(g.size):
            if gp[i] * g[i] > 0:
                eta[i] = min(hi * eta[i], gmax)
                gp[i] = g[i]
            elif gp[i] * g[i] < 0:
                eta[i] = max(lo * eta[i], gmin)
                gp[i] = 0.0
            else:
                gp[i] = g[i]
        return (gp, eta), eta * np.sign(gp)
    return Ref(lambda x: (np.zeros_like(x), np.full_like(x, lr)), apply)


def r_rmsprop(lr=0.001, rho=0.9, eps=1e-8, centred=False):
    lr, rho, eps = f32(lr), f32(rho), f32(eps)

    def apply(s, x, g):
        q, l = s
        q = rho * q + (1 - rho) * g ** 2
        l = rho * l + (1 - rho) * g
        denom = np.sqrt(q - l ** 2) if centred else np.sqrt(q)
        return (q, l), lr * g / (denom + eps)
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x)), apply)


def _adam_init(beta):
    return lambda x: (np.zeros_like(x), np.zeros_like(x), 1)


def r_adam(lr=0.001, beta=(0.9, 0.999), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, v, t = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        return (m, v, t + 1), lr * mh / (np.sqrt(vh) + eps)
    return Ref(_adam_init(beta), apply)


def r_radam(lr=0.001, beta=(0.9, 0.999), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)
    rho_inf = 2 / (1 - b2) - 1

    def apply(s, x, g):
        m, v, t = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        bt1, bt2 = b1 ** t, b2 ** t
        mh, vh = m / (1 - bt1), v / (1 - bt2)
        rho = rho_inf - 2 * t * bt2 / (1 - bt2)
        if rho > 4:
            r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            delta = lr * r * mh / (np.sqrt(vh) + eps)
        else:
            delta = lr * mh
        return (m, v, t + 1), delta
    return Ref(_adam_init(beta), apply)


def r_adamax(lr=0.001, beta=(0.9, 0.999), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, u, t = s
        m = b1 * m + (1 - b1) * g
        u = np.maximum(b2 * u, np.abs(g))
        return (m, u, t + 1), lr * (m / (1 - b1 ** t)) / (u + eps)
    return Ref(_adam_init(beta), apply)


def r_oadam(lr=0.001, beta=(0.5, 0.9), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, v, t, T = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        Tn = lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        return (m, v, t + 1, Tn), 2 * Tn - T
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x), 1, np.zeros_like(x)), apply)


def r_adagrad(lr=0.1, eps=1e-8):
    lr, eps = f32(lr), f32(eps)

    def apply(acc, x, g):
        acc = acc + g ** 2
        return acc, lr * g / (np.sqrt(acc) + eps)
    return Ref(lambda x: np.full_like(x, eps), apply)


def r_adadelta(rho=0.9, eps=1e-8):
    rho, eps = f32(rho), f32(eps)

    def apply(s, x, g):
        a, d = s
        a = rho * a + (1 - rho) * g ** 2
        delta = g * np.sqrt(d + eps) / np.sqrt(a + eps)
        d = rho * d + (1 - rho) * delta ** 2
        return (a, d), delta
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x)), apply)


def r_amsgrad(lr=0.001, beta=(0.9, 0.999), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, v, vh = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        vh = np.maximum(vh, v)
        return (m, v, vh), lr * m / (np.sqrt(vh) + eps)
    return Ref(lambda x: (np.full_like(x, eps), np.full_like(x, eps), np.full_like(x, eps)), apply)


def r_nadam(lr=0.001, beta=(0.9, 0.999), eps=1e-8):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, v, t = s
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        bt1, bt2 = b1 ** t, b2 ** t
        num = b1 * m / (1 - b1 * bt1) + (1 - b1) * g / (1 - bt1)
        return (m, v, t + 1), lr * num / (np.sqrt(v * b2 / (1 - bt2)) + eps)
    return Ref(_adam_init(beta), apply)


def r_adamw(lr=0.001, beta=(0.9, 0.999), weight_decay=0.0, eps=1e-8, couple=True):
    lr, lam = f32(lr), f32(weight_decay)
    inner = r_adam(1.0, beta, eps)

    def apply(s, x, g):
        s, A = inner.apply(s, x, g)
        return s, (lr * (A + lam * x) if couple else lr * A + lam * x)
    return Ref(inner.init, apply)


def r_adabelief(lr=0.001, beta=(0.9, 0.999), eps=1e-16):
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(st, x, g):
        m, s, t = st
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * (g - m) ** 2 + eps
        return (m, s, t + 1), lr * (m / (1 - b1 ** t)) / (np.sqrt(s / (1 - b2 ** t)) + eps)
    return Ref(_adam_init(beta), apply)


def r_lion(lr=1e-4, beta=(0.9, 0.99)):
    """The paper (Chen et al. 2023, arXiv:2302.06675): step with the previous m, then update m."""
    lr, (b1, b2) = f32(lr), f32(beta)

    def apply(m, x, g):
        delta = lr * np.sign(b1 * m + (1 - b1) * g)
        return b2 * m + (1 - b2) * g, delta
    return Ref(np.zeros_like, apply)


def r_lion_optimisers_jl(lr=1e-4, beta=(0.9, 0.99)):
    """Optimisers.jl v0.4's Lion (the swapped EMA weights), only to show optim does NOT do this."""
    lr, (b1, b2) = f32(lr), f32(beta)

    def apply(m, x, g):
        m = b2 * g + (1 - b2) * m
        return m, lr * np.sign((b2 - b1) * g + b1 * m)
    return Ref(np.zeros_like, apply)


def r_weightdecay(lam=5e-4):
    lam = f32(lam)
    return Ref(lambda x: None, lambda s, x, g: (s, g + lam * x))


def r_signdecay(lam=1e-3):
    lam = f32(lam)
    return Ref(lambda x: None, lambda s, x, g: (s, g + lam * np.sign(x)))


def r_clipgrad(delta=10.0):
    delta = f32(delta)
    return Ref(lambda x: None, lambda s, x, g: (s, np.clip(g, -delta, delta)))


def r_clipnorm(omega=10.0, p=2):
    omega = f32(omega)

    def norm(g):
        if p == 0:
            return float(np.count_nonzero(g))
        if p == np.inf:
            return float(np.max(np.abs(g)))
        return float(np.sum(np.abs(g) ** p) ** (1 / p))

    return Ref(lambda x: None, lambda s, x, g: (s, g * min(omega / norm(g), 1.0)))


def r_chain(*rules):
    def init(x):
        return [r.init(x) for r in rules]

    def apply(states, x, g):
        new = []
        for r, s in zip(rules, states):
            s, g = r.apply(s, x, g)
            new.append(s)
        return new, g
    return Ref(init, apply)



def r_adopt(lr=1e-3, beta=(0.9, 0.9999), eps=1e-6, nesterov=False, clip=True):
    """The paper (Taniguchi et al. 2024, arXiv:2411.02853, Algorithm 2) as `optax.contrib.adopt` writes it: the
    first step only sets v; then g is normalised by the previous v and clipped to t^(1/4) (t = steps taken)."""
    lr, (b1, b2), eps = f32(lr), f32(beta), f32(eps)

    def apply(s, x, g):
        m, v, t = s
        if t == 0:
            return (m, g ** 2, 1), np.zeros_like(g)
        u = g / np.maximum(np.sqrt(v), eps)
        if clip:
            u = np.clip(u, -t ** 0.25, t ** 0.25)
        m = b1 * m + (1 - b1) * u
        step = b1 * m + (1 - b1) * u if nesterov else m
        return (m, b2 * v + (1 - b2) * g ** 2, t + 1), lr * step
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x), 0), apply)


def r_ademamix(lr=1e-3, beta=(0.9, 0.999), beta3=0.9999, alpha=5.0, eps=1e-8, weight_decay=0.0):
    """The paper (Pagliardini et al. 2024, arXiv:2409.03050, Algorithm 1) as `optax.contrib.ademamix` writes it:
    the fast moment and the second moment bias-corrected, the slow moment not; the decay multiplied by lr."""
    lr, (b1, b2), b3, alpha, eps, lam = f32(lr), f32(beta), f32(beta3), f32(alpha), f32(eps), f32(weight_decay)

    def apply(s, x, g):
        m1, m2, v, t = s
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3 * m2 + (1 - b3) * g
        v = b2 * v + (1 - b2) * g ** 2
        m1_hat, v_hat = m1 / (1 - b1 ** t), v / (1 - b2 ** t)
        return (m1, m2, v, t + 1), lr * ((m1_hat + alpha * m2) / (np.sqrt(v_hat) + eps) + lam * x)
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x), np.zeros_like(x), 1), apply)


def r_cautious(inner, decay=None):
    """Cautious (Liang et al. 2024, arXiv:2411.16085, Algorithm 1; C-Optim's C-Lion and the original C-AdamW):
    the inner step u, the mask (u g > 0) rescaled by n / (sum(mask) + 1) over the parameter, and `decay(x)` (a
    decoupled weight decay, e.g. lr * lam * x) added unmasked. `inner` is the rule without its decay."""
    def apply(s, x, g):
        s, u = inner.apply(s, x, g)
        mask = (u * g > 0).astype(np.float64)
        delta = u * mask * (mask.size / (mask.sum() + 1))
        return s, delta if decay is None else delta + decay(x)
    return Ref(inner.init, apply)


def r_prodigy(lr=1.0, beta=(0.9, 0.999), beta3=None, eps=1e-8, estim_lr0=1e-6, estim_lr_coef=1.0, weight_decay=0.0,
              safeguard_warmup=False):
    """Prodigy (Mishchenko & Defazio 2023, arXiv:2306.06101, Algorithm 4, the Adam version) as
    `optax.contrib.prodigy` writes it, for a model of one parameter (the sums are over it): the moments of d g,
    the weighted numerator r and sum s decayed by beta3 = sqrt(beta2) unless given, d = max(d, coef r / |s|_1),
    the step with the old d in lr d bc and the new one beside eps, the decay multiplied by lr d bc."""
    lr, (b1, b2), eps, d0 = f32(lr), f32(beta), f32(eps), f32(estim_lr0)
    coef, lam = f32(estim_lr_coef), f32(weight_decay)
    b3 = math.sqrt(b2) if beta3 is None else f32(beta3)

    def apply(s, x, g):
        m, v, acc, x0, d, r, k = s
        k += 1
        dlr = lr * d * math.sqrt(1 - b2 ** k) / (1 - b1 ** k)
        r = b3 * r + (d / d0) * dlr * float(np.sum(g * (x0 - x)))
        m = b1 * m + (1 - b1) * d * g
        v = b2 * v + (1 - b2) * (d * g) ** 2
        acc = b3 * acc + ((d if safeguard_warmup else dlr) / d0) * d * g
        den = float(np.sum(np.abs(acc)))
        d_new = max(d, coef * r / den) if den > 0 else d
        return (m, v, acc, x0, d_new, r, k), dlr * m / (np.sqrt(v) + d_new * eps) + lam * dlr * x
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x), np.zeros_like(x), x.copy(), d0, 0.0, 0), apply)


def r_dog(lr=1.0, reps_rel=1e-6, eps=1e-8, init_learning_rate=None):
    """DoG (Ivgi et al. 2023, arXiv:2302.12022, Algorithm 1) as `optax.contrib.dog` writes it, for a model of one
    parameter: r = max(r_eps, max_k |x_k - x0|), G = sum_k |g_k|^2, step = lr r / sqrt(G + eps) g, with
    r_eps = reps_rel (1 + |x0|), or r_eps = 0 and the first step size init_learning_rate."""
    lr, rel, eps = f32(lr), f32(reps_rel), f32(eps)
    first = None if init_learning_rate is None else f32(init_learning_rate)

    def init(x):
        return x.copy(), (rel * (1 + float(np.linalg.norm(x))) if first is None else 0.0), 0.0, True

    def apply(s, x, g):
        x0, r, big_g, is_first = s
        r = max(r, float(np.linalg.norm(x - x0)))
        big_g += float(np.sum(g ** 2))
        size = first if (first is not None and is_first) else r / math.sqrt(big_g + eps)
        return (x0, r, big_g, False), lr * size * g
    return Ref(init, apply)


def _inverse_root_np(m, p, eps):
    """`(M + r I)^(-1/p)` by eigh with `r = eps * max(λ_max, 1e-6)` (precondition-opt's
    `matrix_inverse_pth_root_eigh`, the largest eigenvalue exact instead of by power iteration)."""
    e, u = np.linalg.eigh(m)
    ridge = eps * max(e[-1], 1e-6)
    return (u * np.maximum(e + ridge, ridge) ** (-1.0 / p)) @ u.T


def _blocks_np(shape, block_size):
    """precondition-opt's `BlockPartitioner`: per axis the (start, stop) of its blocks (the last one shorter)."""
    return [[(i, min(i + block_size, d)) for i in range(0, d, block_size)] for d in shape]


def r_shampoo(lr=1e-3, beta=(0.9, 0.999), block_size=1024, precondition_every=100, start_preconditioning_step=101,
              graft="adam", matrix_eps=1e-6, weight_decay=0.0, diagonal_eps=1e-10, nesterov=True, cast=f32):
    """distributed Shampoo as precondition-opt's `distributed_shampoo` computes it (`_compute_stats`,
    `_compute_preconditioners`, `_transform_grad`), with `best_effort_shape_interpretation=False`,
    `skip_preconditioning_rank_lt=2`, `eigh=True`, weight decay decoupled (times `lr` once), and an "adam" graft:
    its RMSProp graft with the second moment bias-corrected. `cast`: how hyperparameters are rounded (f32 for
    a float32 parameter; `float` for float64)."""
    lr, eps, wd, deps = cast(lr), cast(matrix_eps), cast(weight_decay), cast(diagonal_eps)
    b1, b2 = cast(beta[0]), cast(beta[1])
    import itertools

    def init(x):
        stats = []
        if x.ndim >= 2:
            for block in itertools.product(*_blocks_np(x.shape, block_size)):
                stats.append([eps * np.eye(b - a) for a, b in block])
        return dict(count=0, stats=stats, roots=[[np.eye(len(s)) for s in st] for st in stats],
                    nu=np.zeros_like(x), m=np.zeros_like(x), mg=np.zeros_like(x))

    def apply(s, x, g):
        t = s["count"]
        if graft == "sgd":
            a = g
        elif graft == "adagrad":
            s["nu"] = s["nu"] + g * g
            a = g / (np.sqrt(s["nu"]) + deps)
        else:
            s["nu"] = b2 * s["nu"] + (1 - b2) * g * g
            nu = s["nu"] / (1 - b2 ** (t + 1)) if graft == "adam" else s["nu"]
            a = g / (np.sqrt(nu) + deps)
        if x.ndim >= 2:
            p = np.zeros_like(g)
            for n, block in enumerate(itertools.product(*_blocks_np(x.shape, block_size))):
                idx = tuple(slice(a_, b_) for a_, b_ in block)
                gb = g[idx]
                for i in range(g.ndim):
                    gi = np.moveaxis(gb, i, 0).reshape(gb.shape[i], -1)
                    s["stats"][n][i] = b2 * s["stats"][n][i] + (1 - b2) * gi @ gi.T
                    if t % precondition_every == 0:
                        s["roots"][n][i] = _inverse_root_np(s["stats"][n][i], 2 * g.ndim, eps)
                pb = gb
                for i in range(g.ndim):   # cyclic contraction: axis 0 each time, moved to the end
                    pb = np.tensordot(pb, s["roots"][n][i], axes=([0], [0]))
                p[idx] = pb
            u = np.linalg.norm(a) / (np.linalg.norm(p) + 1e-25) * p
        else:
            u = a
        s["m"] = b1 * s["m"] + u
        s["mg"] = b1 * s["mg"] + a
        run = t >= start_preconditioning_step
        m, u = (s["m"], u) if run else (s["mg"], a)
        n = u + b1 * m if nesterov else m
        s["count"] = t + 1
        return s, lr * (n + wd * x)

    return Ref(init, apply)


def _ns_reference(g, steps, eps, coeffs=(3.4445, -4.7750, 2.0315)):
    """Muon's quintic Newton-Schulz (Jordan 2024) on the wide orientation of `g`, after `g / (‖g‖_F + ε)`."""
    a, b, c = coeffs
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def r_normuon(lr=0.02, rho=0.95, beta2=0.95, eps=1e-8, weight_decay=0.0, steps=5, nesterov=True,
              consistent_rms=None):
    """NorMuon for a matrix W of shape (in, out) used as `x @ W`, from the paper (Li et al. 2025,
    arXiv:2510.05491, Algorithm 1) and its code (github.com/zichongli5/NorMuon, `normuon_update`): Muon's
    orthogonalised momentum O (the direction as optax.contrib.muon forms it: the Nesterov momentum
    bias-corrected), `v_j ← β₂ v_j + (1 - β₂) mean_i O_ij²` per output neuron j (a column here, a row of
    PyTorch's (out, in) weight), `Ô = O / (√v + ε)` rescaled to ‖O‖_F, then Muon's shape scale and the decoupled
    decay `η λ W`. Hyperparameters are not rounded (compare it with float64 parameters)."""
    def apply(s, x, g):
        m, v, t = s
        t += 1
        m = rho * m + (1 - rho) * g
        if nesterov:
            u = rho * m / (1 - rho ** (t + 1)) + (1 - rho) * g / (1 - rho ** t)
        else:
            u = m / (1 - rho ** t)
        o = _ns_reference(u, steps, eps)
        v = beta2 * v + (1 - beta2) * np.mean(o ** 2, axis=0)
        o_hat = o / (np.sqrt(v) + eps)
        o_hat *= np.linalg.norm(o) / np.linalg.norm(o_hat)
        fan_in, fan_out = x.shape
        scale = (max(1.0, fan_out / fan_in) ** 0.5 if consistent_rms is None
                 else consistent_rms * max(fan_in, fan_out) ** 0.5)
        return (m, v, t), lr * (scale * o_hat + weight_decay * x)
    return Ref(lambda x: (np.zeros_like(x), np.zeros(x.shape[1]), 0), apply)


def r_mars(lr=3e-3, beta=(0.95, 0.99), gamma=0.025, eps=1e-8, weight_decay=0.0):
    """MARS-AdamW, approximate (Yuan et al. 2024, arXiv:2411.10438), as its code writes it
    (github.com/AGI-Arena/MARS, `mars.py`: `update_fn` with `mars_type="mars-adamw"`, `is_approx=True`): the
    previous gradient starts at 0; `c = g + γ β₁/(1-β₁) (g - g_prev)`, divided by its norm where that exceeds 1;
    Adam's moments of c with `denom = (√v / √(1-β₂ᵗ) + ε)(1-β₁ᵗ)`; the decay `η λ x`."""
    lr, (b1, b2), gamma, eps, lam = f32(lr), f32(beta), f32(gamma), f32(eps), f32(weight_decay)

    def apply(s, x, g):
        m, v, last, t = s
        t += 1
        c = g + gamma * (b1 / (1 - b1)) * (g - last)
        norm = np.sqrt(np.sum(c ** 2))
        if norm > 1:
            c = c / norm
        m = b1 * m + (1 - b1) * c
        v = b2 * v + (1 - b2) * c * c
        denom = (np.sqrt(v) / math.sqrt(1 - b2 ** t) + eps) * (1 - b1 ** t)
        return (m, v, g, t), lr * (lam * x + m / denom)
    return Ref(lambda x: (np.zeros_like(x), np.zeros_like(x), np.zeros_like(x), 0), apply)


def _kron_draws(seed, count, shape, dtype):
    """The balancing draw and the probe of PSGD Kron at a parameter's count: psgd-jax's keys for a model of one
    parameter (`fold_in(PRNGKey(seed), count)`, then its splits), drawn with JAX (the only JAX in this module:
    numpy cannot reproduce JAX's generator), in the run's dtype, returned as float64."""
    import jax
    key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
    _, sub = jax.random.split(key)
    key, balance = jax.random.split(sub)
    _, probe = jax.random.split(key)
    u = float(jax.random.uniform(balance))
    v = np.asarray(jax.random.normal(jax.random.split(probe, 1)[0], shape, dtype), np.float64)
    return u, v


def _lower_bound_np(a):
    """psgd-jax's `_norm_lower_bound` of a symmetric matrix."""
    s = np.max(np.abs(a))
    if s == 0:
        return 0.0
    b = a / s
    col, row = np.sum(b * b, axis=0), np.sum(b * b, axis=1)
    if col.max() > row.max():
        x = b[:, np.argmax(col)] @ b
        return s * np.linalg.norm((x / np.linalg.norm(x)) @ b.T)
    x = b @ b[np.argmax(row), :]
    return s * np.linalg.norm(b.T @ (x / np.linalg.norm(x)))


def r_kron(lr=1e-3, b1=0.9, weight_decay=0.0, preconditioner_update_probability=1.0, max_size_triangular=8192,
           precond_lr=0.1, seed=0, cast=f32, dtype=np.float32):
    """PSGD Kron as psgd-jax's `kron` computes it (`scale_by_kron`, `_init_Q_exprs`, `_conjB`, `_update_precond`,
    `_precond_grad`; min_ndim_triangular 2, init scale 1, momentum into the preconditioner update), the update
    probability a number, for a model of one parameter; a scalar as a vector of one. `dtype`: the run's dtype,
    in which the random numbers are drawn."""
    lr, b1, wd, p, plr = cast(lr), cast(b1), cast(weight_decay), cast(preconditioner_update_probability), \
        cast(precond_lr)
    damp = float(np.sqrt(np.finfo(np.float32).eps))
    tiny = float(np.finfo(dtype).tiny)

    def init(x):
        shape = x.shape or (1,)
        tri = [len(x.shape) >= 2 and 1 < d <= max_size_triangular for d in shape]
        return dict(count=0, counter=0, mu=np.zeros(shape), qs=[np.eye(d) if t else np.ones(d) for d, t in
                                                                  zip(shape, tri)])

    def along(a, i, m):      # m applied along axis i (a matrix: m @ a_(i); a vector: elementwise)
        if m.ndim == 1:
            return a * m.reshape((-1,) + (1,) * (a.ndim - 1 - i))
        return np.moveaxis(np.tensordot(m, a, axes=([1], [i])), 0, i)

    def gram(a, i, tri):
        mat = np.moveaxis(a, i, 0).reshape(a.shape[i], -1)
        return mat @ mat.T if tri else np.sum(mat * mat, axis=1)

    def apply(s, x, g):
        shape = x.shape
        g = g.reshape(g.shape or (1,))
        t = s["count"] + 1
        s["mu"] = b1 * s["mu"] + (1 - b1) * g
        m = s["mu"] / (1 - b1 ** t)
        s["counter"] += 1
        if s["counter"] >= 1 / p:
            s["counter"] = 0
            u, v = _kron_draws(seed, s["count"], m.shape, dtype)
            qs = s["qs"]
            if u < 0.01 and len(qs) > 1:
                norms = [np.max(np.abs(q)) for q in qs]
                mean = np.prod(norms) ** (1 / len(qs))
                qs = [q * mean / n for q, n in zip(qs, norms)]
            a = m + damp * np.mean(np.abs(m)) * v
            b = v
            for i, q in enumerate(qs):
                a = along(a, i, q)
                b = along(b, i, 1 / q if q.ndim == 1 else np.linalg.inv(q).T)
            new = []
            for i, q in enumerate(qs):
                t1, t2 = gram(a, i, q.ndim == 2), gram(b, i, q.ndim == 2)
                if q.ndim == 1:
                    new.append(q - plr * (t1 - t2) * q / (tiny + np.max(np.abs(t1 + t2))))
                else:
                    new.append(q - plr * np.triu(t1 - t2) / (tiny + _lower_bound_np(t1 + t2)) @ q)
            s["qs"] = new
        pg = m
        for i, q in enumerate(s["qs"]):
            pg = along(pg, i, q ** 2 if q.ndim == 1 else q.T @ q)
        pg = pg / max(1.0, np.sqrt(np.mean(pg * pg)) / 1.1)
        s["count"] = t
        return s, lr * (pg.reshape(shape) + wd * x)

    return Ref(init, apply)
