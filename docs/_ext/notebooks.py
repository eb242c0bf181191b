"""The notebooks as docs pages, with their outputs: `python docs/_ext/notebooks.py` (about a minute).

notebooks/*.ipynb are committed without outputs. This runs each one top to bottom (nbclient, with this interpreter
as the kernel: the same run as tests/test_notebooks.py, which imports `kernel_spec`, `RUNNER` and `execute` from
here) and writes what a reader of the site sees:

- notebooks/rendered/NAME.md: the markdown cells, the code cells (```py, not run by the docs' tests) and what
  each printed (```output blocks) or drew (an image). The install cell (the one that `pip install`s optim where
  it is missing) is left out: the page says how to install instead.
- docs/images/notebooks/NAME-K.png: the K-th figure the notebook drew.
- notebooks/rendered/NAME.json: per figure, its PNG's SHA-256 and what it draws (`figure_data`: titles, labels,
  legends and each array drawn), which the kernel gives beside each PNG (STARTUP).
- docs/notebooks/NAME.md: the page, which includes notebooks/rendered/NAME.md (snippets). The notebooks' code is
  formatted to the docs' code column (`ruff format --line-length 80`; tests/test_notebooks.py checks the width).

The rendered files are committed: running the notebooks takes ~50 s on 2 cores, too slow for every `mkdocs build`
(and it would need the test extra's Jupyter packages in a docs-only install). tests/test_notebooks.py, which runs
every notebook anyway, renders each run again and fails when the committed page differs (`differences`): the code
and text exactly; printed numbers within RTOL; the figures by what they draw, not by their pixels (the same
titles, labels and legends, as many arrays and points, their values within LINEAR or LOG of their range).
Another CPU rounds a training run differently: the tolerances and what they were measured on are under
"freshness" below.

    python docs/_ext/notebooks.py                  # every notebook
    python docs/_ext/notebooks.py 02_tied_weights  # one
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
RENDERED = NOTEBOOKS / "rendered"
PAGES = ROOT / "docs" / "notebooks"
IMAGES = ROOT / "docs" / "images" / "notebooks"
KERNEL = "optim-test-python"


# Run by the kernel as it starts: each matplotlib figure the notebook shows also gives FIGURE_DATA, what it
# draws as numbers and text (`figure_data`), beside its PNG in the same output. It is registered with the
# mime-bundle formatter: the inline backend removes figures from every per-type formatter when pyplot loads.
STARTUP = """
def _optim_docs_figure_data():
    import importlib.util
    from IPython import get_ipython
    spec = importlib.util.spec_from_file_location("_optim_docs_notebooks", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_ipython().display_formatter.mimebundle_formatter.for_type_by_name(
        "matplotlib.figure", "Figure", lambda fig: {{module.FIGURE_DATA: module.figure_data(fig)}})
_optim_docs_figure_data()
del _optim_docs_figure_data
"""
FIGURE_DATA = "application/vnd.optim.figure-data+json"


def kernel_spec(root: Path) -> str:
    """A folder of kernelspecs holding one, KERNEL: this interpreter, inline matplotlib figures, no warnings, and
    each figure's data beside its PNG (STARTUP)."""
    spec = Path(root) / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "startup.py").write_text(STARTUP.format(path=str(Path(__file__).resolve())))
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 f"--IPKernelApp.exec_files={spec / 'startup.py'}"],
        "display_name": "optim tests", "language": "python",
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline", "PYTHONWARNINGS": "ignore"},
    }))
    return str(root)


# Each notebook runs in a child process: nbclient leaves its kernel client's channel threads (and their ZMQ
# sockets) alive in the process that executed the notebook, and they would stay for the rest of a test session.
# It prints one JSON line; given a fifth argument, it writes the executed notebook (with its outputs) there.
RUNNER = r"""
import json, re, sys, time
import nbclient, nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

path, kernels, name, folder = sys.argv[1:5]
nb = nbformat.read(path, as_version=4)
km = KernelManager(kernel_name=name,
                   kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels], ensure_native_kernel=False))
client = nbclient.NotebookClient(nb, km=km, timeout=600, allow_errors=False, resources={"metadata": {"path": folder}})
t = time.perf_counter()
error = None
try:
    client.execute()
except nbclient.exceptions.CellExecutionError as e:
    error = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
if len(sys.argv) > 5:
    nbformat.write(nb, sys.argv[5])
print(json.dumps({"error": error, "seconds": time.perf_counter() - t, "images": images}))
"""


def execute(path: Path, kernels: str, out: Path | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run the notebook at `path` in a child process (RUNNER): the process, and its JSON line (None if it failed).
    With `out`, the executed notebook is written there."""
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path), kernels, KERNEL, str(NOTEBOOKS),
                        *([str(out)] if out else [])], capture_output=True, text=True, timeout=900)
    got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    return r, got


# ---------------------------------------------------------------------------------------------------- render
def is_install_cell(cell) -> bool:
    return cell.cell_type == "code" and "pip" in cell.source and 'find_spec("optim")' in cell.source


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def _fence(lang: str, text: str) -> str:
    ticks = "````" if "```" in text else "```"
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def render(nb, name: str) -> tuple[str, dict[str, bytes], dict[str, dict | None]]:
    """An executed notebook as the markdown of its page, its figures (file name in IMAGES -> PNG bytes) and what
    each figure draws (file name -> `figure_data`, None if the kernel gave none)."""
    parts, images, drawn, section = [], {}, {}, name
    for i, cell in enumerate(nb.cells):
        if is_install_cell(cell):
            continue
        if cell.cell_type == "markdown":
            parts.append(cell.source.strip() + "\n")
            if i == 0:
                parts.append(INSTALL_NOTE.format(name=name))
            headings = re.findall(r"^#+\s+(.+)$", cell.source, re.M)
            section = headings[-1] if headings else section
            continue
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        parts.append(_fence("py", cell.source))
        printed = []

        def flush():
            if printed:
                parts.append(_fence("output", "".join(printed)))
                printed.clear()

        for o in cell.get("outputs", []):
            if o.output_type == "stream" and o.name == "stdout":
                printed.append(_text(o.text))
            elif o.output_type in ("execute_result", "display_data"):
                data = o.get("data", {})
                if "image/png" in data:
                    flush()
                    file = f"{name}-{len(images) + 1}.png"
                    images[file] = base64.b64decode(_text(data["image/png"]))
                    drawn[file] = data.get(FIGURE_DATA)
                    parts.append(f"![A figure drawn by the cell above ({section})]"
                                 f"(../images/notebooks/{file})\n")
                elif "text/plain" in data:
                    printed.append(_text(data["text/plain"]) + "\n")
            elif o.output_type == "error":   # not run with allow_errors; shown if it ever is
                printed.append("\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in o.traceback) + "\n")
        flush()
    return "\n".join(parts), images, drawn


def figure_data(fig) -> dict:
    """What a matplotlib figure draws, as text and numbers: for each of its axes the title, labels, scales, texts
    and legend, and each array it draws (`drawn_array`): the x and y of its lines, patches and collections, the values
    of its collections and images. Tick labels are left out: they follow from the data's range."""
    import numpy as np

    def array(values, log: bool = False) -> dict:
        return drawn_array(np.ma.filled(np.ma.asarray(values, dtype=np.float64), np.nan).ravel().tolist(), log)

    def xy(points, scales) -> dict:
        points = np.ma.filled(np.ma.asarray(points, dtype=np.float64), np.nan).reshape(-1, 2)
        return {"x": array(points[:, 0], scales[0] == "log"), "y": array(points[:, 1], scales[1] == "log")}

    axes = []
    for ax in fig.axes:
        scales = [ax.get_xscale(), ax.get_yscale()]
        legend = ax.get_legend()
        axes.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(), "scales": scales,
            "texts": [t.get_text() for t in ax.texts],
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            "lines": [xy(line.get_xydata(), scales) for line in ax.lines],
            "patches": [xy(p.get_patch_transform().transform(p.get_path().vertices), scales) for p in ax.patches],
            "collections": [{**xy(c.get_offsets(), scales), "values": array([] if c.get_array() is None
                                                                           else c.get_array())}
                            for c in ax.collections],
            "images": [{"shape": list(np.shape(im.get_array())), "values": array(im.get_array())} for im in ax.images],
        })
    return {"axes": axes}


QUANTILES = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1)


def drawn_array(values: list[float], log: bool = False) -> dict:
    """An array as a figure draws it: how many values (`n`) and how many are drawn (finite, and positive on a log
    axis); on a linear axis the drawn values (`values`), on a log axis the first, the last and the QUANTILES
    (nearest rank) of their log10 (`quantiles`). 5 significant digits."""
    kept = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
    out = {"n": len(values), "drawn": len(kept)}
    if not log:
        return {**out, "values": [float(f"{v:.5g}") for v in kept]}
    logs = [math.log10(v) for v in kept]
    ranked = sorted(logs)
    picked = [logs[0], logs[-1]] + [ranked[round(q * (len(ranked) - 1))] for q in QUANTILES] if logs else []
    return {**out, "quantiles": [float(f"{v:.5g}") for v in picked]}


INSTALL_NOTE = """!!! note "This page is a notebook"
    `notebooks/{name}.ipynb` in the repository, run on a CPU, with what each cell printed and drew. To run it
    yourself, install optim ([Getting started](../getting-started.md)) and open the notebook in Jupyter; its
    first cell, which installs optim where it is missing, is not shown here.
"""

PAGE = """<!-- Written by docs/_ext/notebooks.py from notebooks/{name}.ipynb: run it again rather than editing this. -->

--8<-- "notebooks/rendered/{name}.md"
"""


def write(name: str, markdown: str, images: dict[str, bytes], drawn: dict[str, dict | None]) -> None:
    """The page, its included markdown, its figures (the notebook's old figures removed) and their data
    (notebooks/rendered/NAME.json: per figure, the PNG's SHA-256 and what it draws)."""
    RENDERED.mkdir(parents=True, exist_ok=True)
    PAGES.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    (RENDERED / f"{name}.md").write_text(markdown)
    (PAGES / f"{name}.md").write_text(PAGE.format(name=name))
    for old in IMAGES.glob(f"{name}-*.png"):
        old.unlink()
    for file, png in images.items():
        (IMAGES / file).write_bytes(png)
    records = {file: {"sha256": hashlib.sha256(png).hexdigest(), "data": drawn[file]} for file, png in images.items()}
    (RENDERED / f"{name}.json").write_text(_dumps(records) + "\n")


def _dumps(x, indent: int = 0) -> str:
    """JSON with a line per dict entry and per dict in a list; other lists on one line."""
    pad, end = " " * (indent + 1), "\n" + " " * indent
    if isinstance(x, dict):
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, indent + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + end + "}"
    if isinstance(x, list) and any(isinstance(v, dict) for v in x):
        return "[\n" + ",\n".join(pad + _dumps(v, indent + 1) for v in x) + end + "]"
    return json.dumps(x, ensure_ascii=False)


# ------------------------------------------------------------------------------------------------ freshness
# A fresh run is compared with the committed page, not with this CPU's last bits: another CPU rounds a training run
# differently (its vector width orders a sum differently) and training grows the difference. The code and the text
# must be equal, a number printed (or written in a figure) within RTOL (relative) or ATOL. An array a figure draws
# must have as many values and as many drawn; on a linear axis each value within LINEAR of the committed array's
# range, on a log axis (training losses, rounding errors: orders of magnitude) its `quantiles` within LOG of the
# committed ones' range, in decades.
# Measured: the quickstart's loss after 200 Adam steps was 0.037760 where the page was first rendered, 0.037233 on
# an AMD EPYC (AVX2), 1.4% apart. With XLA limited to other instruction sets on one AVX2 machine (XLA_FLAGS=
# --xla_cpu_max_isa=SSE4_2 or AVX) the four notebooks' printed numbers moved by 1.9% at most (that loss); arrays
# on a linear axis by 1.3% of their range at most (the quickstart's fitted curve), every other one by under 0.01%;
# on a log axis, the quickstart's training loss (600 steps at a learning rate of 3e-2, which pass unstable stretches
# at different steps) moved by two decades at single steps, by 2x at the end, and its quantiles by 0.10 of their
# range. The tolerances are 3x those.
RTOL, ATOL, LINEAR, LOG = 0.06, 1e-5, 0.04, 0.3
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _close(a, b) -> bool:
    x, y = float(a), float(b)
    return abs(x - y) <= ATOL + RTOL * max(abs(x), abs(y))


def _same_text(a: str, b: str) -> bool:
    """Two lines are the same apart from their numbers, which are _close."""
    na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
    return a == b or (_NUMBER.sub("#", a) == _NUMBER.sub("#", b) and len(na) == len(nb)
                      and all(_close(x, y) for x, y in zip(na, nb)))


def _array_difference(want: dict, got: dict) -> str | None:
    """How two `drawn_array` arrays differ (None: not beyond rounding): their counts, or the value (on a linear axis) or
    quantile of log10 (on a log axis) furthest apart, beyond LINEAR or LOG of the committed numbers' range (of
    their largest magnitude when all are equal)."""
    key, share = ("values", LINEAR) if "values" in want else ("quantiles", LOG)
    w, g = want[key], got[key]
    if (want["n"], want["drawn"], len(w)) != (got["n"], got["drawn"], len(g)):
        return f"{want['n']} values ({want['drawn']} drawn) committed, {got['n']} ({got['drawn']} drawn) now"
    scale = (max(w) - min(w)) or max(map(abs, w)) if w else 0.0
    k = max(range(len(w)), key=lambda i: abs(w[i] - g[i]), default=None)
    if k is None or abs(w[k] - g[k]) <= share * scale + ATOL:
        return None
    what = f"value {k}" if key == "values" else f"log10 {(['first', 'last'] + [f'q{q:g}' for q in QUANTILES])[k]}"
    return f"{what}: {w[k]} committed, {g[k]} now, more than {share} of the range {scale:.4g} apart"


def text_differences(want: str, got: str) -> list[str]:
    """Lines of two renderings that differ in more than their numbers' rounding."""
    w, g = want.splitlines(), got.splitlines()
    if len(w) != len(g):
        return [f"{len(w)} lines committed, {len(g)} rendered now"]
    return [f"line {k}:\n  committed: {a}\n  now:       {b}"
            for k, (a, b) in enumerate(zip(w, g), start=1) if not _same_text(a, b)]


def data_differences(want, got, where: str = "") -> list[str]:
    """Where two `figure_data` differ: the same structure, strings the same apart from their numbers (_close),
    arrays within LINEAR or LOG (_array_difference)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if sorted(want) != sorted(got):
            return [f"{where or 'the data'}: keys {sorted(want)} committed, {sorted(got)} now"]
        if "drawn" in want:
            d = _array_difference(want, got)
            return [f"{where}: {d}"] if d else []
        return [d for k in want for d in data_differences(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} committed, {len(got)} now"]
        return [d for k, (a, b) in enumerate(zip(want, got)) for d in data_differences(a, b, f"{where}[{k}]")]
    if isinstance(want, int) and isinstance(got, int):      # an image's shape
        same = want == got
    else:
        same = isinstance(want, str) and isinstance(got, str) and _same_text(want, got)
    return [] if same else [f"{where}: {want!r} committed, {got!r} now"]


def differences(name: str, markdown: str, images: dict[str, bytes], drawn: dict[str, dict | None]) -> list[str]:
    """How the committed page of notebook `name` differs from this rendering of it (empty: fresh). Its figures are
    compared by what they draw (`figure_data`, recorded in notebooks/rendered/NAME.json with each PNG's SHA-256),
    not by their pixels."""
    page, rendered, records = PAGES / f"{name}.md", RENDERED / f"{name}.md", RENDERED / f"{name}.json"
    if not rendered.exists() or not page.exists() or not records.exists():
        return [f"{page.relative_to(ROOT)}, {rendered.relative_to(ROOT)} or {records.relative_to(ROOT)} is missing"]
    out = []
    if page.read_text() != PAGE.format(name=name):
        out.append(f"{page.relative_to(ROOT)} is not the page this script writes")
    out += [f"{rendered.relative_to(ROOT)}, {d}" for d in text_differences(rendered.read_text(), markdown)]
    committed = {p.name for p in IMAGES.glob(f"{name}-*.png")}
    if committed != set(images):
        out.append(f"figures committed {sorted(committed)}, drawn now {sorted(images)}")
    recorded = json.loads(records.read_text())
    if set(recorded) != committed:
        out.append(f"{records.relative_to(ROOT)} records {sorted(recorded)}, figures committed {sorted(committed)}")
    for file in sorted(committed & set(images) & set(recorded)):
        if hashlib.sha256((IMAGES / file).read_bytes()).hexdigest() != recorded[file]["sha256"]:
            out.append(f"docs/images/notebooks/{file} is not the figure {records.relative_to(ROOT)} records")
        if drawn[file] is None:
            out.append(f"{file}: the kernel gave no figure data ({FIGURE_DATA})")
        else:
            out += [f"docs/images/notebooks/{file}, {d}" for d in
                    data_differences(recorded[file]["data"], drawn[file], "figure")]
    return out


def main(argv: list[str]) -> None:
    import nbformat

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if argv:
        paths = [p for p in paths if p.stem in argv]
    with tempfile.TemporaryDirectory() as tmp:
        kernels = kernel_spec(Path(tmp) / "kernels")
        for path in paths:
            out = Path(tmp) / path.name
            r, got = execute(path, kernels, out)
            if got is None or got["error"]:
                sys.exit(f"{path.name} failed:\n{(got or {}).get('error') or r.stderr[-4000:]}")
            markdown, images, drawn = render(nbformat.read(out, as_version=4), path.stem)
            write(path.stem, markdown, images, drawn)
            print(f"{path.name}: {got['seconds']:.0f} s, {len(images)} figures -> "
                  f"{(PAGES / path.name).with_suffix('.md').relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
