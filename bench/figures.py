"""The docs' figures, drawn from the results the benchmarks wrote (`python -m bench.figures`).

Each figure is drawn from data in the repository, never by re-running a benchmark: bench/RESULTS.json (the step
time ratios), bench/CHOOSING.json and bench/LOWMEM.json (loss curves), the schedules themselves, and one run cheap
enough to compute here (the tie drift: a few dozen steps of a tiny tied model, optax against optim). They are
written to docs/images/ and the pages show them; tests/test_figures.py draws each again into a temporary folder
and checks that the committed PNG is the same file, byte for byte, so a figure cannot go stale behind its data.

For that the PNG must depend on nothing but the data: matplotlib's defaults (not the user's matplotlibrc), a
fixed size and resolution, the fonts matplotlib ships, no metadata (`Software` would name matplotlib's version),
and numbers rounded to 4 significant digits before they are drawn, so that a last-bit difference in a computed
run (another CPU's vector width) cannot move a pixel.

    python -m bench.figures                    # every figure into docs/images/
    python -m bench.figures --only tie-drift   # one of them
    python -m bench.figures --out /tmp/figs    # somewhere else
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
IMAGES = ROOT / "docs" / "images"
# `python -m bench.gpu --md bench/GPU.md --json bench/GPU.json` on a machine with a GPU writes this; until it is
# committed there is no GPU chart (the docs say no GPU numbers are measured yet).
GPU_RESULTS = BENCH / "GPU.json"

DPI = 110
STYLE = {
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": DPI,
}


def _round(a, digits: int = 4) -> np.ndarray:
    """Numbers to `digits` significant digits: what is drawn does not depend on a computation's last bits."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(a == 0, 1.0, 10.0 ** (digits - 1 - np.floor(np.log10(np.abs(a)))))
    return np.round(a * scale) / scale


@contextlib.contextmanager
def _figure(path: Path, *args, **kwargs):
    """A pyplot figure drawn with matplotlib's defaults plus STYLE, saved to `path` without metadata."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(STYLE)
        fig = plt.figure(*args, **kwargs)
        try:
            yield fig
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=DPI, metadata={"Software": None})
        finally:
            plt.close(fig)


# ------------------------------------------------------------------------------ step time ratios (RESULTS.json)
WORKLOAD_LABELS = {
    "1x16M": "1 matrix\n16.8M",
    "100x160k": "100 matrices\nof 160k",
    "1000x16k": "1000 matrices\nof 16k",
    "3000x1.6k": "3000 matrices\nof 1.6k",
    "10000x1.6k": "10000 matrices\nof 1.6k",
    "tied-lm": "transformer\n(tied, 17.8M)",
    "untied-lm": "transformer\n(untied, 17.8M)",
}
RATIO_CANDIDATES = {   # name in the results: (legend, colour)
    "optim jit": ("optim, inside jax.jit", "#1f77b4"),
    "optim eager donate": ("optim, eager, donate=True", "#6baed6"),
    "optax": ("optax.adam, jitted (the reference)", "#7f7f7f"),
    "torch fused": ("torch.optim.Adam(fused=True)", "#ff7f0e"),
    "torch foreach": ("torch.optim.Adam(foreach=True)", "#fdae6b"),
}


def step_ratios(path: Path, results: Path = BENCH / "RESULTS.json", where: str = "CPU") -> None:
    """Adam's step time relative to optax's, per workload and candidate: the benchmarks page's summary table."""
    sections = json.loads(results.read_text())["sections"]
    workloads = [w for w in WORKLOAD_LABELS if sections.get(w, {}).get("rows")]
    width = 0.8 / len(RATIO_CANDIDATES)
    with _figure(path, figsize=(10.4, 4.0)) as fig:
        ax = fig.subplots()
        for i, (name, (label, colour)) in enumerate(RATIO_CANDIDATES.items()):
            xs = np.arange(len(workloads)) + (i - (len(RATIO_CANDIDATES) - 1) / 2) * width
            vals = [sections[w]["rows"].get(name, {}).get("vs_optax") for w in workloads]
            got = [(x, v) for x, v in zip(xs, vals) if v is not None]
            bars = ax.bar([x for x, _ in got], _round([v for _, v in got], 3), width * 0.92, color=colour,
                          label=label)
            ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in got], fontsize=5.5, padding=1.5, rotation=90)
            for x, v in zip(xs, vals):
                if v is None:
                    ax.text(x, 0.03, "not run", rotation=90, fontsize=6, ha="center", va="bottom",
                            color="#999999")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(workloads)), [WORKLOAD_LABELS[w] for w in workloads])
        ax.set_ylabel("step time / optax's (lower is faster)")
        ax.set_ylim(0, 4.6)
        ax.grid(axis="x", visible=False)
        ax.set_title(f"Adam's step, relative to a jitted optax.adam step in the same round ({where})")
        ax.legend(loc="upper right", ncols=2, frameon=False)
        fig.tight_layout()


GPU_CANDIDATES = {   # bench.gpu's row names: (legend, colour)
    "optim Adam": ("optim.Adam, jitted", "#1f77b4"),
    "optim Adam bf16 moments": ("optim.Adam, bfloat16 moments", "#6baed6"),
    "optax Adam": ("optax.adam, jitted (the reference)", "#7f7f7f"),
    "torch Adam fused": ("torch.optim.Adam(fused=True)", "#ff7f0e"),
}


def gpu_ratios(path: Path, results: Path = GPU_RESULTS) -> None:
    """`python -m bench.gpu`'s results: Adam's step time relative to optax's on the GPU, per workload."""
    data = json.loads(results.read_text())
    workloads = list(data["workloads"])
    names = [n for n in GPU_CANDIDATES if any(n in w["rows"] for w in data["workloads"].values())]
    width = 0.8 / len(names)
    top = max([1.0] + [r["ratio"] for w in data["workloads"].values() for n, r in w["rows"].items()
                       if n in names and r.get("ratio") is not None])
    with _figure(path, figsize=(7.2, 3.8)) as fig:
        ax = fig.subplots()
        for i, name in enumerate(names):
            label, colour = GPU_CANDIDATES[name]
            xs = np.arange(len(workloads)) + (i - (len(names) - 1) / 2) * width
            got = [(x, data["workloads"][w]["rows"].get(name, {}).get("ratio")) for x, w in zip(xs, workloads)]
            got = [(x, v) for x, v in got if v is not None]
            bars = ax.bar([x for x, _ in got], _round([v for _, v in got], 3), width * 0.92, color=colour,
                          label=label)
            ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in got], fontsize=6.5, padding=1.5)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(workloads)), [WORKLOAD_LABELS.get(w, w) for w in workloads])
        ax.set_ylabel("step time / optax's (lower is faster)")
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, 1.45 * top)   # room for the legend
        ax.set_title(f"Adam's step, relative to a jitted optax.adam step ({data['device']})")
        ax.legend(loc="upper left", frameon=False, fontsize=7)
        fig.tight_layout()


# ------------------------------------------------------------------------------------------------- tie drift
TIE_STEPS = 40


def tie_drift_data(steps: int = TIE_STEPS) -> dict[str, np.ndarray]:
    """A tiny language model whose embedding is also its output projection (one array at two paths), trained by
    `optax.adam` and by `optim.Adam` on the same batches: the distance between the two copies at the start and
    after each step, and the tied matrix's entry [0, 0] at both paths."""
    import jax
    import jax.numpy as jnp
    import optax

    import optim

    vocab, width, batch = 16, 8, 64
    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab, (steps, batch + 1)).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.key(0))
    emb = 0.3 * jax.random.normal(k1, (vocab, width))
    model = {"embed": emb, "hidden": jax.random.normal(k2, (width, width)) / np.sqrt(width), "unembed": emb}

    def loss(m, ids):
        h = jnp.tanh(m["embed"][ids[:-1]] @ m["hidden"])
        logp = jax.nn.log_softmax(h @ m["unembed"].T)
        return -jnp.take_along_axis(logp, ids[1:, None], axis=1).mean()

    tx = optax.adam(3e-2)

    @jax.jit
    def optax_step(p, s, ids):
        u, s = tx.update(jax.grad(loss)(p, ids), s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def optim_step(s, m, ids):
        return optim.update(s, m, jax.grad(loss)(m, ids))

    out = {k: [] for k in ("optax distance", "optim distance", "optax embed", "optax unembed", "optim embed")}
    p, s = model, tx.init(model)
    state, m = optim.setup(optim.Adam(3e-2), model), model
    for t in range(steps + 1):
        if t:   # step 0: where both start
            p, s = optax_step(p, s, data[t - 1])
            state, m = optim_step(state, m, data[t - 1])
        out["optax distance"].append(float(jnp.linalg.norm(p["embed"] - p["unembed"])))
        out["optim distance"].append(float(jnp.linalg.norm(m["embed"] - m["unembed"])))
        out["optax embed"].append(float(p["embed"][0, 0]))
        out["optax unembed"].append(float(p["unembed"][0, 0]))
        out["optim embed"].append(float(m["embed"][0, 0]))
    return {k: _round(v) for k, v in out.items()}


def tie_drift(path: Path) -> None:
    d = tie_drift_data()
    steps = np.arange(len(d["optax distance"]))
    with _figure(path, figsize=(9.6, 3.4)) as fig:
        a, b = fig.subplots(1, 2)
        a.plot(steps, d["optax distance"], color="#d62728", lw=1.8, label="optax.adam")
        a.plot(steps, d["optim distance"], color="#1f77b4", lw=1.8, label="optim.Adam (0 at every step)")
        a.set(xlabel="step", ylabel="‖embed − unembed‖", title="distance between the two copies of the tied matrix")
        a.legend(frameon=False)
        b.plot(steps, d["optax embed"], color="#d62728", lw=1.8, label='optax: params["embed"][0, 0]')
        b.plot(steps, d["optax unembed"], color="#d62728", lw=1.8, ls="--", label='optax: params["unembed"][0, 0]')
        b.plot(steps, d["optim embed"], color="#1f77b4", lw=1.8, label="optim: both paths (one array)")
        b.set(xlabel="step", ylabel="value", title="one entry of the tied matrix, at both paths")
        b.legend(frameon=False)
        fig.tight_layout()


# ------------------------------------------------------------------------------------------------ schedules
SCHEDULE_STEPS = 1000


def schedule_cases() -> list[tuple[str, list[tuple[str | None, Callable]]]]:
    """(title, [(line label, schedule)]) for each public schedule, over SCHEDULE_STEPS steps."""
    import optim

    return [
        ("Constant(1.0)", [(None, optim.Constant(1.0))]),
        ("Linear(0.0, 1.0, 500)", [(None, optim.Linear(0.0, 1.0, 500))]),
        ("Cosine(1.0, 1000, final=0.1)", [(None, optim.Cosine(1.0, 1000, final=0.1))]),
        ("Piecewise((300, 600),\n(1.0, 0.3, 0.1))", [(None, optim.Piecewise((300, 600), (1.0, 0.3, 0.1)))]),
        ("Join((Linear(0.0, 1.0, 200),\nExponential(1.0, 0.1, 800)), (200,))",
         [(None, optim.Join((optim.Linear(0.0, 1.0, 200), optim.Exponential(1.0, 0.1, 800)), (200,)))]),
        ("warmup_cosine(1.0, 100, 1000,\nfinal=0.1)", [(None, optim.warmup_cosine(1.0, 100, 1000, final=0.1))]),
        ("WSD(1.0, 100, 600, 300, shape=...)",
         [(shape, optim.WSD(1.0, 100, 600, 300, shape=shape)) for shape in ("linear", "cosine", "1-sqrt")]),
        ("InvSqrt(1.0, 100)", [(None, optim.InvSqrt(1.0, 100))]),
        ("Exponential(1.0, 0.5, 250)\nand staircase=True",
         [("smooth", optim.Exponential(1.0, 0.5, 250)),
          ("staircase", optim.Exponential(1.0, 0.5, 250, staircase=True))]),
        ("Polynomial(1.0, 0.0, 2, 1000)", [(None, optim.Polynomial(1.0, 0.0, 2, 1000))]),
    ]


def schedules(path: Path) -> None:
    """Each public schedule's value at steps 0 to SCHEDULE_STEPS - 1, one small panel each."""
    import jax.numpy as jnp

    cases = schedule_cases()
    t = np.arange(SCHEDULE_STEPS)
    with _figure(path, figsize=(10.4, 4.6)) as fig:
        axes = fig.subplots(2, 5, sharex=True, sharey=True).ravel()
        for ax, (title, lines) in zip(axes, cases):
            for label, s in lines:
                ax.plot(t, _round(np.broadcast_to(np.asarray(s(jnp.asarray(t))), t.shape)), lw=1.6, label=label)
            ax.set_title(title, fontsize=7.5)
            if lines[0][0] is not None:
                ax.legend(frameon=False, fontsize=6.5, loc="lower center")
        for ax in axes[5:]:
            ax.set_xlabel("step")
        for ax in axes[::5]:
            ax.set_ylabel("value")
        axes[0].set_ylim(-0.05, 1.1)
        fig.tight_layout()


# ------------------------------------------------------------------------------------------------ loss curves
def _running_mean(c, k: int) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(c, dtype=np.float64)
    smooth = np.convolve(c, np.ones(k) / k, mode="valid")
    return np.arange(len(smooth)) + k, _round(smooth)


def choosing_loss(path: Path, results: Path = BENCH / "CHOOSING.json") -> None:
    """The choosing page's comparison: each optimiser's training loss on the demo LM (running mean)."""
    data = json.loads(results.read_text())
    k = data.get("k", 20)
    with _figure(path, figsize=(8.0, 4.0)) as fig:
        ax = fig.subplots()
        for name, r in data["rows"].items():
            x, y = _running_mean(r["losses"], k)
            ax.plot(x, y, lw=1.4, label=f"{name} (held-out {r['held_out_loss']:.3f})")
        ax.set(xlabel="step", ylabel=f"training loss, nats per character (mean of {k} steps)", ylim=(2.2, 3.6),
               title=f"the demo's tied character LM ({data['n_params']:,} parameters), "
                     f"{data['steps']} steps, same batches")
        ax.legend(frameon=False, ncols=2)
        fig.tight_layout()


def lowmem_loss(path: Path, results: Path | dict = BENCH / "LOWMEM.json") -> None:
    """The low-memory runs' training loss (running mean), one panel per model. `bench.lowmem` draws it too,
    from the results it has just measured."""
    data = results if isinstance(results, dict) else json.loads(results.read_text())
    models = data["models"]
    with _figure(path, figsize=(6 * len(models), 4)) as fig:
        for ax, (model, m) in zip(fig.subplots(1, len(models), squeeze=False)[0], models.items()):
            for name, r in m["runs"].items():
                x, y = _running_mean(r["curve"], max(len(r["curve"]) // 30, 1))
                ax.plot(x, y, label=name, lw=1.2)
            ax.set_title(model)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (running mean)")
            ax.legend(fontsize=7, frameon=False)
        fig.tight_layout()


# ---------------------------------------------------------------------------------------------------- all
def figures() -> dict[str, Callable[[Path], None]]:
    """File name in docs/images/ -> the function that draws it (the GPU chart only when its results exist)."""
    out = {
        "bench-cpu-ratios.png": step_ratios,
        "tie-drift.png": tie_drift,
        "schedules.png": schedules,
        "choosing-loss.png": choosing_loss,
        "lowmem-loss.png": lowmem_loss,
    }
    if GPU_RESULTS.exists():
        out["bench-gpu-ratios.png"] = gpu_ratios
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=IMAGES, help="folder to write the PNGs into (docs/images/)")
    p.add_argument("--only", nargs="*", help="figure names (without .png), e.g. tie-drift schedules")
    a = p.parse_args(argv)
    todo = figures()
    if a.only:
        unknown = set(a.only) - {n.removesuffix(".png") for n in todo}
        if unknown:
            p.error(f"no figure named {sorted(unknown)}; there are {sorted(todo)}")
        todo = {n: f for n, f in todo.items() if n.removesuffix(".png") in a.only}
    for name, draw in todo.items():
        draw(a.out / name)
        print(f"{a.out / name}: {(a.out / name).stat().st_size / 1024:.0f} KB")
    if not GPU_RESULTS.exists():
        print(f"no {GPU_RESULTS.relative_to(ROOT)}: no GPU chart (no GPU numbers are measured yet)")


if __name__ == "__main__":
    main()
