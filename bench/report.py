"""Render the saved results (RESULTS.json) as markdown (RESULTS.md)."""

from __future__ import annotations

from . import candidates as C
from .workloads import ORDER

METHOD = """\
Method: the machine's memory bandwidth drifts (about 2x over minutes), so absolute times are only indicative.
Every step figure comes from one process per workload in which all candidates run interleaved, round by round
(the order rotates each round); a sample is `reps` back-to-back steps followed by one block, `reps` chosen so
a sample takes about `--target` seconds. *vs optax* is the median over rounds of the per-round ratio to the
`optax` candidate (lower is better; the IQR of that ratio is in brackets). *vs floor* is the median per-round
ratio to Adam's bandwidth floor, estimated from the in-place probe (jitted, donated `a += b` over the same
number of parameters: 12 bytes/param) scaled to Adam's 28 bytes/param (read p, g, m, v; write p, m, v); 1.0
would be perfect streaming, and 1/x is the fraction of probe bandwidth reached. *First call* (trace + compile
+ one step) and *peak RSS* (high-water mark, includes the workload's own arrays) come from a separate process
per candidate. *State* is optimiser-state bytes divided by the unique parameter bytes.

Candidates: `optim eager` = `optim.update(state, model, grads)`; `optim eager donate` = the same with
`donate=True`; `optim jit` = `optim.update` inside the user's `jax.jit(..., donate_argnums=(0, 1))`; `optim jit
xla` = the same with optim's fused CPU kernel off (`OPTIM_FUSED=0`: XLA's code for the rule); `optax` =
`optax.adam` step under `jax.jit` donating (params, opt_state); `optax.flatten` = `optax.flatten(optax.adam)`
likewise; `torch foreach` / `torch fused` = `torch.optim.Adam(foreach=True / fused=True)` on CPU tensors
(gradients preset, `opt.step()` only); `probe` = the bandwidth probe. Tied model: every donating JAX candidate
gets a model whose tied positions are distinct buffers (JAX refuses to donate one buffer twice); optim's tie map
keeps them tied, optax treats them as two parameters (so it stores and updates the head too). Each section
names the optim commit it measured; the repository changes often, so sections may differ."""


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _first_cell(r: dict | None, key: str, fmt: str) -> str:
    if not r:
        return "–"
    if "timeout" in r:
        return f"timeout > {r['timeout']:.0f} s"
    if "oom" in r:
        return f"out of memory (> {r['oom'] / 1024:.1f} GB)"
    if "error" in r:
        return "killed (OOM?)" if "SIGKILL" in r["error"] else "error"
    return fmt.format(r[key])


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def workload_table(sec: dict) -> list[str]:
    raw = sec.get("raw", {})
    rows = sec.get("rows", {})
    first = sec.get("first", {})
    out = [f"### {sec['workload']}", ""]
    when = f"measured {sec['date']} (optim {sec.get('optim', '?')})"
    if raw.get("loadavg"):
        when += f", load average {raw['loadavg'][0]:.1f} -> {raw['loadavg'][1]:.1f}"
    if raw.get("torch_threads"):
        when += f", torch threads {raw['torch_threads']}"
    if raw.get("description"):
        nr = max((r.get("rounds", 0) for r in rows.values()), default=0)
        out += [f"{raw['description']}; {when}, {nr} rounds.", ""]
    elif "timeout" in raw:
        out += [f"Step process timed out (> {raw['timeout']:.0f} s); {when}.", ""]
    elif "error" in raw:
        out += [f"Step process failed: {raw['error']}; {when}.", ""]
    out += ["| candidate | step (ms) | Mparam/s | vs optax | vs floor | first call (s) | peak RSS (MB) | "
            "first call vs optax | RSS vs optax | state |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref_first = first.get(C.REFERENCE, {})
    ub = raw.get("unique_bytes")
    names = [n for n in C.ALL + C.WRAPPED if n in rows or n in first]
    names += [n for n in rows if n.endswith(C.UNTIED)]
    for n in names:
        r, f = rows.get(n, {}), first.get(n)
        if "error" in r:
            step = r["error"].replace("|", "/")[:120]
            cells = [step, "", "", ""]
        elif r:
            iqr = r.get("vs_optax_iqr") or (None, None)
            vs = _f(r.get("vs_optax"))
            if r.get("vs_optax") is not None and iqr[0] is not None and n != C.REFERENCE:
                vs += f" ({iqr[0]:.2f}–{iqr[1]:.2f})"
            cells = [_f(r["step_s"] * 1e3, "{:.3g}"), _f(r["params_per_s"] / 1e6, "{:.0f}"), vs,
                     _f(r.get("vs_floor"))]
        else:
            cells = [sec.get("skipped", {}).get(n, "–"), "", "", ""]
        fc = _first_cell(f, "first_s", "{:.2f}")
        rss = _first_cell(f, "peak_rss_mb", "{:.0f}")
        fvs = rvs = "–"
        if f and "first_s" in f and "first_s" in ref_first:
            fvs = _f(_ratio(f["first_s"], ref_first["first_s"]))
            rvs = _f(_ratio(f["peak_rss_mb"], ref_first["peak_rss_mb"]))
        sb = raw.get("state_bytes", {}).get(n)
        if sb is None and f:
            sb = f.get("state_bytes")
        state = "–" if (sb is None or not ub or n == "probe") else f"{sb / ub:.2f}x"
        out.append(f"| {n} | " + " | ".join(cells + [fc, rss, fvs, rvs, state]) + " |")
    twins = [(n, r["vs_untied"]) for n, r in rows.items() if "vs_untied" in r]
    if twins:
        out += ["", f"`X{C.UNTIED}` is candidate X on the untied twin (same unique parameters, no head position), "
                "in the same process. Tied step / untied step, median of per-round ratios: "
                + ", ".join(f"{n} {v:.2f}" for n, v in twins) + "."]
    return out + [""]


def summary_table(sections: dict) -> list[str]:
    wls = [w for w in ORDER if sections.get(w, {}).get("rows")]
    if not wls:
        return []
    out = ["## Summary: step time relative to optax (median per-round ratio, lower is better)", "",
           "| candidate | " + " | ".join(wls) + " |", "|---|" + "---:|" * len(wls)]
    for n in C.ALL:
        cells = []
        for w in wls:
            r = sections[w]["rows"].get(n)
            if r is None:
                cells.append("–")
            elif "error" in r:
                cells.append("error")
            else:
                cells.append(_f(r.get("vs_optax")))
        if any(c != "–" for c in cells):
            out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "Optax absolute step time (ms) in the same runs: "
            + ", ".join(f"{w} {sections[w]['rows'].get('optax', {}).get('step_s', 0) * 1e3:.3g}"
                        for w in wls if "step_s" in sections[w]["rows"].get("optax", {})) + ".", ""]
    return out


def targets(sections: dict) -> list[str]:
    """Issues 5's and 13's targets, checked against the latest numbers (optim jit and optim eager separately)."""
    out = ["## Issue 5 targets", "", "| target | candidate | measured | goal | met |", "|---|---|---:|---:|:-:|"]

    def row(what, cand, val, goal, ok=None):
        if val is None:
            out.append(f"| {what} | {cand} | not measured | {goal} | – |")
            return
        met = ok if ok is not None else val <= float(goal.lstrip("<= "))
        out.append(f"| {what} | {cand} | {val:.2f} | {goal} | {'yes' if met else 'NO'} |")

    def get(w, cand, key):
        return sections.get(w, {}).get("rows", {}).get(cand, {}).get(key)

    def first_ratio(w, cand, key):
        f = sections.get(w, {}).get("first", {})
        a, b = f.get(cand, {}), f.get(C.REFERENCE, {})
        if key in a and key in b:
            return a[key] / b[key]
        return None

    for cand in ("optim jit", "optim eager donate", "optim eager"):
        row("10000x1.6k first call / optax", cand, first_ratio("10000x1.6k", cand, "first_s"), "<= 0.1")
        row("10000x1.6k peak RSS / optax", cand, first_ratio("10000x1.6k", cand, "peak_rss_mb"), "<= 0.25")
        row("10000x1.6k step / optax", cand, get("10000x1.6k", cand, "vs_optax"), "<= 0.5")
        row("1000x16k step / optax", cand, get("1000x16k", cand, "vs_optax"), "<= 0.8")
        row("1x16M step / optax", cand, get("1x16M", cand, "vs_optax"), "<= 1.0")
    ov = sections.get("overhead", {}).get("rows", {}).get("optim eager", {}).get("vs_optax")
    row("eager call on 10 leaves / optax jitted step", "optim eager", ov, "<= 1.3")
    for cand in ("optim jit", "optim eager donate", "optim eager"):
        sb = sections.get("tied-lm", {}).get("raw", {}).get("state_bytes", {}).get(cand)
        ub = sections.get("tied-lm", {}).get("raw", {}).get("unique_bytes")
        if sb is not None and ub:
            v = sb / ub
            row("tied: state bytes / unique param bytes", cand, v, "2.00", ok=abs(v - 2) < 0.01)
        v = get("tied-lm", cand, "vs_untied")
        if v is None:       # older results: compare across processes through the probe
            v = _ratio(get("tied-lm", cand, "vs_floor"), get("untied-lm", cand, "vs_floor"))
        row("tied step / untied-twin step", cand, v, "<= 1.0")
    st = sections.get("setup", {}).get("rows", {}).get("optim.setup", {}).get("setup_s")
    row("optim.setup on 10000 leaves (ms)", "optim", None if st is None else st * 1e3, "<= 50")
    # Issue 13 (performance II: packs, hoisting, the fused CPU kernel).
    out += ["", "## Issue 13 targets", "", "| target | candidate | measured | goal | met |", "|---|---|---:|---:|:-:|"]
    for cand in ("optim jit", "optim eager donate"):
        row("1x16M step / optax", cand, get("1x16M", cand, "vs_optax"), "<= 0.65")
        row("1000x16k step / optax", cand, get("1000x16k", cand, "vs_optax"), "<= 0.75")
        row("1000x16k first call / optax", cand, first_ratio("1000x16k", cand, "first_s"), "<= 0.5")
        row("3000x1.6k step / optax", cand, get("3000x1.6k", cand, "vs_optax"), "<= 0.4")
        row("3000x1.6k first call / optax", cand, first_ratio("3000x1.6k", cand, "first_s"), "<= 0.15")
        row("tied LM step / optax", cand, get("tied-lm", cand, "vs_optax"), "<= 0.6")
        row("tied LM first call / optax", cand, first_ratio("tied-lm", cand, "first_s"), "<= 1.0")
    row("eager call on 10 leaves / optax jitted step", "optim eager", ov, "<= 1.0")
    return out + [""]


def render(data: dict) -> str:
    sections = data.get("sections", {})
    info = data.get("machine", {})
    out = ["# optim benchmarks", "",
           f"Generated by `{data.get('command', 'python -m bench')}`, last updated {data.get('date', '?')}. "
           "Regenerate with `python -m bench` (all), or e.g. `python -m bench --only 10000x1.6k` to re-measure "
           "one section and merge it here.", "",
           "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), "", METHOD, ""]
    out += summary_table(sections)
    out += targets(sections)
    out += ["## Workloads", ""]
    for w in ORDER:
        if w in sections:
            out += workload_table(sections[w])
    ov = sections.get("overhead")
    if ov:
        out += ["## Eager per-call overhead", "",
                f"{ov.get('raw', {}).get('description', '')}; measured {ov['date']} "
                f"(optim {ov.get('optim', '?')}). Time per call, interleaved; "
                "*vs optax* is the ratio to the jitted, donated optax step.", "",
                "| candidate | per call (us) | vs optax |", "|---|---:|---:|"]
        for n, r in ov.get("rows", {}).items():
            if "error" in r:
                out.append(f"| {n} | {r['error'][:120]} | |")
            else:
                out.append(f"| {n} | {r['call_s'] * 1e6:.1f} | {_f(r.get('vs_optax'))} |")
        if "rows" not in ov:
            out.append(f"| (failed) | {ov.get('raw')} | |")
        out.append("")
    su = sections.get("setup")
    if su:
        out += ["## Setup time", "", f"{su.get('raw', {}).get('description', '')}; measured {su['date']} "
                f"(optim {su.get('optim', '?')}); "
                "median of interleaved rounds (`optax init` = `optax.adam(1e-3).init(params)`, eager, for scale).",
                "", "| | time (ms) |", "|---|---:|"]
        for n, r in su.get("rows", {}).items():
            out.append(f"| {n} | {r['setup_s'] * 1e3:.1f} |")
        if "rows" not in su:
            out.append(f"| (failed) | {su.get('raw')} |")
        out.append("")
    from . import step                           # the whole-step section, measured by `python -m bench.step`
    out += step.saved_section()                  # (kept from bench/STEP.json when this file is regenerated)
    notes = data.get("notes")
    if notes:                                    # bench/NOTES.md: hand-written analysis, kept across runs
        out += [notes.strip(), ""]
    return "\n".join(out)
