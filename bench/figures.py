"""The docs' figures, drawn from the results the benchmarks wrote (`python -m bench.figures`).

Each figure is drawn from data in the repository, never by re-running a benchmark: bench/RESULTS.json (the step
time ratios), bench/CHOOSING.json and bench/LOWMEM.json (loss curves), and two computations cheap enough to run
here: the schedules themselves and the tie drift (a few dozen steps of a tiny tied model, optax against optim).
They are written to docs/images/ and the pages show them. A figure (`figures()[name]`) is its data (`.data()`:
every number and label it draws) and its drawing (`.draw(data, path)`).

tests/test_figures.py checks that no figure is stale, without depending on this CPU's rounding:

- a figure read from a results file is drawn again from that file and must be the committed PNG byte for byte.
  What it draws is computed the same on every machine: sums by `math.fsum`, rounding by Python's formatting
  (both correctly rounded), no vectorised numpy path whose last bits depend on the CPU;
- a computed figure (schedules, tie drift) runs float32 JAX, whose last bits do depend on the CPU: what it drew
  is recorded in bench/FIGURES.json. The test computes the data again and compares it with the record within the
  figure's tolerance (`Figure.tolerance`), then draws the *recorded* data and requires the committed PNG byte
  for byte (the picture is that data, drawn by this code).

For the byte comparisons the PNG must depend on nothing but the data: matplotlib's defaults (not the user's
matplotlibrc), a fixed size and resolution, the fonts matplotlib ships, no metadata (`Software` would name
matplotlib's version), and numbers rounded to 4 significant digits before they are drawn.

    python -m bench.figures                    # every figure into docs/images/ (and bench/FIGURES.json)
    python -m bench.figures --only tie-drift   # one of them
    python -m bench.figures --out /tmp/figs    # somewhere else (the records in /tmp/figs/FIGURES.json)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
IMAGES = ROOT / "docs" / "images"
# `python -m bench.gpu --md bench/GPU.md --json bench/GPU.json` on a machine with a GPU writes this; until it is
# committed there is no GPU chart (the docs say no GPU numbers are measured yet).
GPU_RESULTS = BENCH / "GPU.json"
# What the computed figures drew (their data, keyed by file name), written with their PNGs.
RECORDS = BENCH / "FIGURES.json"

# Drawn for the docs' content column (about 690 px at a 1280 px window): 6.4 in at 200 dpi is 1280 px, shown at
# about half size, so a 10 pt text is about 15 px on the page, the size of the body text; a click on a figure
# opens it at full size (docs/_ext/hooks.py). One panel per row: side by side, each would be half as wide again.
DPI = 200
WIDTH = 6.4
STYLE = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": DPI,
}


def _round(a, digits: int = 4) -> list[float]:
    """Numbers to `digits` significant digits, as Python floats. Python's formatting rounds correctly, so the same
    numbers give the same result on every machine (numpy's log10 and round would not: their vectorised paths
    depend on the CPU)."""
    return [float(f"{float(v):.{digits}g}") for v in np.ravel(np.asarray(a, dtype=np.float64))]


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


def step_ratios_data(results: Path = BENCH / "RESULTS.json", where: str = "CPU") -> dict:
    """The workloads with results, and each candidate's step time relative to optax's on each (None: not run)."""
    sections = json.loads(results.read_text())["sections"]
    workloads = [w for w in WORKLOAD_LABELS if sections.get(w, {}).get("rows")]
    return {"where": where, "workloads": workloads,
            "ratios": {name: [sections[w]["rows"].get(name, {}).get("vs_optax") for w in workloads]
                       for name in RATIO_CANDIDATES}}


def _ratio_bars(fig, workloads: list[str], ratios: dict[str, list], candidates: dict, title: str) -> None:
    """Horizontal bars, a group per workload (top to bottom) and a bar per candidate, each labelled with its value:
    a bar chart's value labels stay at the text's size however many workloads there are."""
    names = [n for n in candidates if any(v is not None for v in ratios.get(n, []))]
    height = 0.84 / len(names)
    top = max([1.0] + [v for n in names for v in ratios[n] if v is not None])
    ax = fig.subplots()
    for i, name in enumerate(names):
        label, colour = candidates[name]
        ys = np.arange(len(workloads)) + (i - (len(names) - 1) / 2) * height
        got = [(y, v) for y, v in zip(ys, ratios[name]) if v is not None]
        bars = ax.barh([y for y, _ in got], _round([v for _, v in got], 3), height * 0.9, color=colour, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in got], padding=2)
        for y, v in zip(ys, ratios[name]):
            if v is None:
                ax.text(0.03, y, "not run", va="center", color="#999999")
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(np.arange(len(workloads)), [WORKLOAD_LABELS.get(w, w) for w in workloads])
    ax.set_ylim(len(workloads) - 0.5, -0.5)   # the first workload at the top
    ax.set_xlim(0, 1.15 * top)
    ax.set_xlabel("step time / optax's (lower is faster)")
    ax.grid(axis="y", visible=False)
    ax.set_title(title)
    fig.legend(loc="outside lower center", ncols=2, frameon=False)


def draw_step_ratios(d: dict, path: Path) -> None:
    workloads = d["workloads"]
    with _figure(path, figsize=(WIDTH, 2.4 + 0.85 * len(workloads)), layout="constrained") as fig:
        _ratio_bars(fig, workloads, d["ratios"], RATIO_CANDIDATES,
                    f"Adam's step, relative to a jitted optax.adam step\nin the same round ({d['where']})")


def step_ratios(path: Path, results: Path = BENCH / "RESULTS.json", where: str = "CPU") -> None:
    """Adam's step time relative to optax's, per workload and candidate: the benchmarks page's summary table."""
    draw_step_ratios(step_ratios_data(results, where), path)


GPU_CANDIDATES = {   # bench.gpu's row names: (legend, colour)
    "optim Adam": ("optim.Adam, jitted", "#1f77b4"),
    "optim Adam bf16 moments": ("optim.Adam, bfloat16 moments", "#6baed6"),
    "optax Adam": ("optax.adam, jitted (the reference)", "#7f7f7f"),
    "torch Adam fused": ("torch.optim.Adam(fused=True)", "#ff7f0e"),
}


def gpu_ratios_data(results: Path = GPU_RESULTS) -> dict:
    """`python -m bench.gpu`'s results: the device, and per workload each candidate's step time / optax's."""
    data = json.loads(results.read_text())
    return {"device": data["device"],
            "ratios": {w: {n: r.get("ratio") for n, r in v["rows"].items() if n in GPU_CANDIDATES}
                       for w, v in data["workloads"].items()}}


def draw_gpu_ratios(d: dict, path: Path) -> None:
    workloads = list(d["ratios"])
    ratios = {n: [d["ratios"][w].get(n) for w in workloads] for n in GPU_CANDIDATES}
    with _figure(path, figsize=(WIDTH, 2.4 + 0.7 * len(workloads)), layout="constrained") as fig:
        _ratio_bars(fig, workloads, ratios, GPU_CANDIDATES,
                    f"Adam's step, relative to a jitted optax.adam step\n({d['device']})")


def gpu_ratios(path: Path, results: Path = GPU_RESULTS) -> None:
    """Adam's step time relative to optax's on the GPU, per workload."""
    draw_gpu_ratios(gpu_ratios_data(results), path)


# ------------------------------------------------------------------------------------------------- tie drift
TIE_STEPS = 40


def tie_drift_data(steps: int = TIE_STEPS) -> dict[str, list[float]]:
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


def draw_tie_drift(d: dict, path: Path) -> None:
    steps = np.arange(len(d["optax distance"]))
    with _figure(path, figsize=(WIDTH, 7.6), layout="constrained") as fig:
        a, b = fig.subplots(2, 1, sharex=True)
        a.plot(steps, d["optax distance"], color="#d62728", lw=1.8, label="optax.adam")
        a.plot(steps, d["optim distance"], color="#1f77b4", lw=1.8, label="optim.Adam (0 at every step)")
        a.set(ylabel="‖embed − unembed‖", title="distance between the two copies of the tied matrix")
        a.legend(frameon=False)
        b.plot(steps, d["optax embed"], color="#d62728", lw=1.8, label='optax: params["embed"][0, 0]')
        b.plot(steps, d["optax unembed"], color="#d62728", lw=1.8, ls="--", label='optax: params["unembed"][0, 0]')
        b.plot(steps, d["optim embed"], color="#1f77b4", lw=1.8, label="optim: both paths (one array)")
        b.set(xlabel="step", ylabel="value", title="one entry of the tied matrix, at both paths")
        b.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16))   # below: the lines fill the panel


def tie_drift(path: Path) -> None:
    draw_tie_drift(tie_drift_data(), path)


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


def schedules_data() -> dict:
    """Each public schedule's value at steps 0 to SCHEDULE_STEPS - 1: panel title -> line label ("": none) ->
    values."""
    import jax.numpy as jnp

    t = np.arange(SCHEDULE_STEPS)
    return {title: {label or "": _round(np.broadcast_to(np.asarray(s(jnp.asarray(t))), t.shape))
                    for label, s in lines}
            for title, lines in schedule_cases()}


def draw_schedules(d: dict, path: Path) -> None:
    """A panel per schedule, two panels a row."""
    rows = math.ceil(len(d) / 2)
    with _figure(path, figsize=(WIDTH, 2.05 * rows + 0.4), layout="constrained") as fig:
        axes = fig.subplots(rows, 2, sharex=True, sharey=True).ravel()
        for ax, (title, lines) in zip(axes, d.items()):
            for label, values in lines.items():
                ax.plot(np.arange(len(values)), values, lw=1.6, label=label or None)
            ax.set_title(title, fontsize=10)
            if next(iter(lines)):
                ax.legend(frameon=False, loc="best")
        for ax in axes[-2:]:
            ax.set_xlabel("step")
        for ax in axes[::2]:
            ax.set_ylabel("value")
        for ax in axes[len(d):]:
            ax.set_visible(False)
        axes[0].set_ylim(-0.05, 1.1)


def schedules(path: Path) -> None:
    draw_schedules(schedules_data(), path)


# ------------------------------------------------------------------------------------------------ loss curves
def _running_mean(c, k: int) -> list[list[float]]:
    """The steps and the means of k consecutive values, each sum correctly rounded (math.fsum): the same on every
    machine."""
    c = [float(v) for v in c]
    smooth = [math.fsum(c[i:i + k]) / k for i in range(len(c) - k + 1)]
    return [list(range(k, k + len(smooth))), _round(smooth)]


def choosing_loss_data(results: Path = BENCH / "CHOOSING.json") -> dict:
    """The choosing page's comparison: each optimiser's training loss on the demo LM (running mean of k steps)."""
    data = json.loads(results.read_text())
    k = data.get("k", 20)
    return {"k": k, "n_params": data["n_params"], "steps": data["steps"],
            "rows": {name: {"held_out_loss": r["held_out_loss"], "curve": _running_mean(r["losses"], k)}
                     for name, r in data["rows"].items()}}


def draw_choosing_loss(d: dict, path: Path) -> None:
    with _figure(path, figsize=(WIDTH, 7.0), layout="constrained") as fig:
        ax = fig.subplots()
        for i, (name, r) in enumerate(d["rows"].items()):     # past the 10 colours of the cycle, dashed
            ax.plot(*r["curve"], lw=1.4, ls="-" if i < 10 else "--",
                    label=f"{name} (held-out {r['held_out_loss']:.3f})")
        ax.set(xlabel="step", ylabel=f"training loss, nats per character\n(mean of {d['k']} steps)", ylim=(2.2, 3.6),
               title=f"the demo's tied character LM ({d['n_params']:,} parameters),\n"
                     f"{d['steps']} steps, same batches")
        fig.legend(loc="outside lower center", ncols=2, frameon=False)


def choosing_loss(path: Path, results: Path = BENCH / "CHOOSING.json") -> None:
    draw_choosing_loss(choosing_loss_data(results), path)


def lowmem_loss_data(results: Path | dict = BENCH / "LOWMEM.json") -> dict:
    """The low-memory runs' training loss (running mean), per model and run."""
    data = results if isinstance(results, dict) else json.loads(results.read_text())
    return {model: {name: _running_mean(r["curve"], max(len(r["curve"]) // 30, 1)) for name, r in m["runs"].items()}
            for model, m in data["models"].items()}


def draw_lowmem_loss(d: dict, path: Path) -> None:
    """A panel per model, one above the other, and one legend for both (the runs are the same)."""
    with _figure(path, figsize=(WIDTH, 1.6 + 3.2 * len(d)), layout="constrained") as fig:
        axes = fig.subplots(len(d), 1, squeeze=False)[:, 0]
        for ax, (model, runs) in zip(axes, d.items()):
            for name, curve in runs.items():
                ax.plot(*curve, label=name, lw=1.2)
            ax.set_title(model)
            ax.set_ylabel("training loss\n(running mean)")
        axes[-1].set_xlabel("step")
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False)


def lowmem_loss(path: Path, results: Path | dict = BENCH / "LOWMEM.json") -> None:
    """The low-memory runs' loss curves. `bench.lowmem` draws it too, from the results it has just measured."""
    draw_lowmem_loss(lowmem_loss_data(results), path)


# ---------------------------------------------------------------------------------------------------- all
class Figure(NamedTuple):
    """A figure of docs/images: `data()` is what it draws, computed from its sources (JSON: numbers, strings,
    lists, dicts), and `draw(data, path)` writes the PNG. `tolerance` is None for a figure read from results
    files (its data is the same on every machine) and `(rtol, atol)` for one computed here: how far another
    CPU's float32 rounding moves a number it draws (`close`). A computed figure's data is recorded in RECORDS."""

    data: Callable[[], dict]
    draw: Callable[[dict, Path], None]
    tolerance: tuple[float, float] | None = None


# The schedules' values are float32 (cos, exp, powers) rounded to 4 digits: another CPU's last bit can move one
# by a unit of the 4th digit (at most 1e-3 of it; none moved with XLA limited to other instruction sets,
# XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 or AVX, on an AVX2 machine). The tie drift is 40 Adam steps of a tiny model,
# where a rounding difference grows: on those instruction sets its numbers moved by 3e-4 at most, and an AMD
# EPYC (AVX2) drew it 44 pixels apart from the figure first committed (drawn elsewhere).
SCHEDULES_TOLERANCE = (2e-3, 1e-6)
TIE_DRIFT_TOLERANCE = (1e-2, 1e-3)


def figures() -> dict[str, Figure]:
    """File name in docs/images/ -> the figure (the GPU chart only when its results exist)."""
    out = {
        "bench-cpu-ratios.png": Figure(step_ratios_data, draw_step_ratios),
        "tie-drift.png": Figure(tie_drift_data, draw_tie_drift, TIE_DRIFT_TOLERANCE),
        "schedules.png": Figure(schedules_data, draw_schedules, SCHEDULES_TOLERANCE),
        "choosing-loss.png": Figure(choosing_loss_data, draw_choosing_loss),
        "lowmem-loss.png": Figure(lowmem_loss_data, draw_lowmem_loss),
    }
    if GPU_RESULTS.exists():
        out["bench-gpu-ratios.png"] = Figure(gpu_ratios_data, draw_gpu_ratios)
    return out


def close(want, got, rtol: float = 0.0, atol: float = 0.0, where: str = "") -> list[str]:
    """Where two figures' data differ: the same structure and strings, each number within
    `atol + rtol * max(|want|, |got|)` (0, 0: equal)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if list(want) != list(got):
            return [f"{where or 'the data'}: keys {list(want)} recorded, {list(got)} now"]
        return [d for k in want for d in close(want[k], got[k], rtol, atol, f"{where}[{k!r}]")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} values recorded, {len(got)} now"]
        return [d for k, (a, b) in enumerate(zip(want, got)) for d in close(a, b, rtol, atol, f"{where}[{k}]")]
    numbers = (int, float)
    if (isinstance(want, numbers) and isinstance(got, numbers) and not isinstance(want, bool)
            and not isinstance(got, bool) and abs(want - got) <= atol + rtol * max(abs(want), abs(got))):
        return []
    return [] if want == got else [f"{where}: {want!r} recorded, {got!r} now"]


def _dumps(x, indent: int = 0) -> str:
    """JSON with a line per dict entry and each list on one line."""
    if not isinstance(x, dict):
        return json.dumps(x, ensure_ascii=False)
    pad = " " * (indent + 1)
    items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, indent + 1)}" for k, v in x.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def records(path: Path = RECORDS) -> dict:
    """The recorded data of the computed figures (file name -> data)."""
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=IMAGES,
                   help="folder to write the PNGs into (docs/images/; the records: bench/FIGURES.json, or "
                        "FIGURES.json in that folder)")
    p.add_argument("--only", nargs="*", help="figure names (without .png), e.g. tie-drift schedules")
    a = p.parse_args(argv)
    todo = figures()
    if a.only:
        unknown = set(a.only) - {n.removesuffix(".png") for n in todo}
        if unknown:
            p.error(f"no figure named {sorted(unknown)}; there are {sorted(todo)}")
        todo = {n: f for n, f in todo.items() if n.removesuffix(".png") in a.only}
    where = RECORDS if a.out.resolve() == IMAGES.resolve() else a.out / RECORDS.name
    recorded = records(where)
    for name, fig in todo.items():
        data = fig.data()
        fig.draw(data, a.out / name)
        if fig.tolerance is not None:
            recorded[name] = data
        print(f"{a.out / name}: {(a.out / name).stat().st_size / 1024:.0f} KB")
    if any(f.tolerance is not None for f in todo.values()):
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(_dumps(dict(sorted(recorded.items()))) + "\n")
        print(f"{where}: what the computed figures drew")
    if not GPU_RESULTS.exists():
        print(f"no {GPU_RESULTS.relative_to(ROOT)}: no GPU chart (no GPU numbers are measured yet)")


if __name__ == "__main__":
    main()
