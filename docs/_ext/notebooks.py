"""The notebooks as docs pages, with their outputs: `python docs/_ext/notebooks.py` (about a minute).

notebooks/*.ipynb are committed without outputs. This runs each one top to bottom (nbclient, with this interpreter
as the kernel: the same run as tests/test_notebooks.py, which imports `kernel_spec`, `RUNNER` and `execute` from
here) and writes what a reader of the site sees:

- notebooks/rendered/NAME.md: the markdown cells, the code cells (```py, not run by the docs' tests) and what
  each printed (```output blocks) or drew (an image). The install cell (the one that `pip install`s optim where
  it is missing) is left out: the page says how to install instead.
- docs/images/notebooks/NAME-K.png: the K-th figure the notebook drew.
- docs/notebooks/NAME.md: the page, which includes notebooks/rendered/NAME.md (snippets) with its code wrapped,
  like the examples page's whole files (the notebooks' lines are wider than the docs' code column).

The rendered files are committed: running the notebooks takes ~50 s on 2 cores, too slow for every `mkdocs build`
(and it would need the test extra's Jupyter packages in a docs-only install). tests/test_notebooks.py, which runs
every notebook anyway, renders each run again and fails when the committed page differs (`differences`): the code
and text exactly, printed numbers within a relative 1e-2 (another CPU rounds a training run differently), the
figures within a few pixels.

    python docs/_ext/notebooks.py                  # every notebook
    python docs/_ext/notebooks.py 02_tied_weights  # one
"""

from __future__ import annotations

import base64
import io
import json
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


def kernel_spec(root: Path) -> str:
    """A folder of kernelspecs holding one, KERNEL: this interpreter, inline matplotlib figures, no warnings."""
    spec = Path(root) / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
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


def render(nb, name: str) -> tuple[str, dict[str, bytes]]:
    """An executed notebook as the markdown of its page, and its figures (file name in IMAGES -> PNG bytes)."""
    parts, images, section = [], {}, name
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
                    parts.append(f"![A figure drawn by the cell above ({section})]"
                                 f"(../images/notebooks/{file})\n")
                elif "text/plain" in data:
                    printed.append(_text(data["text/plain"]) + "\n")
            elif o.output_type == "error":   # not run with allow_errors; shown if it ever is
                printed.append("\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in o.traceback) + "\n")
        flush()
    return "\n".join(parts), images


INSTALL_NOTE = """!!! note "This page is a notebook"
    `notebooks/{name}.ipynb` in the repository, run on a CPU, with what each cell printed and drew. To run it
    yourself, install optim ([Getting started](../getting-started.md)) and open the notebook in Jupyter; its
    first cell, which installs optim where it is missing, is not shown here.
"""

PAGE = """<!-- Written by docs/_ext/notebooks.py from notebooks/{name}.ipynb: run it again rather than editing this. -->
<div class="wrap-code" markdown>

--8<-- "notebooks/rendered/{name}.md"

</div>
"""


def write(name: str, markdown: str, images: dict[str, bytes]) -> None:
    """The page, its included markdown and its figures (the notebook's old figures removed)."""
    RENDERED.mkdir(parents=True, exist_ok=True)
    PAGES.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    (RENDERED / f"{name}.md").write_text(markdown)
    (PAGES / f"{name}.md").write_text(PAGE.format(name=name))
    for old in IMAGES.glob(f"{name}-*.png"):
        old.unlink()
    for file, png in images.items():
        (IMAGES / file).write_bytes(png)


# ------------------------------------------------------------------------------------------------ freshness
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _close(a: str, b: str, rtol: float = 1e-2, atol: float = 1e-5) -> bool:
    x, y = float(a), float(b)
    return abs(x - y) <= atol + rtol * max(abs(x), abs(y))


def text_differences(want: str, got: str) -> list[str]:
    """Lines of two renderings that differ in more than their numbers' last digits."""
    out = []
    w, g = want.splitlines(), got.splitlines()
    if len(w) != len(g):
        return [f"{len(w)} lines committed, {len(g)} rendered now"]
    for k, (a, b) in enumerate(zip(w, g), start=1):
        if a == b:
            continue
        na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
        if (_NUMBER.sub("#", a) != _NUMBER.sub("#", b) or len(na) != len(nb)
                or not all(_close(x, y) for x, y in zip(na, nb))):
            out.append(f"line {k}:\n  committed: {a}\n  now:       {b}")
    return out


def image_differences(want: bytes, got: bytes, *, level: int = 32, share: float = 1e-3) -> str | None:
    """None if two PNGs show the same picture: equal sizes, and at most `share` of the pixels differing by more
    than `level` (of 255) in a channel (a curve rounded differently moves a few pixels; a new title, a new
    curve or a changed axis moves many more)."""
    if want == got:
        return None
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(io.BytesIO(x)).convert("RGBA"), dtype=np.int16) for x in (want, got))
    if a.shape != b.shape:
        return f"size {a.shape[1]}x{a.shape[0]} committed, {b.shape[1]}x{b.shape[0]} now"
    moved = (np.abs(a - b) > level).any(axis=-1).mean()
    return None if moved <= share else f"{100 * moved:.2f}% of the pixels differ"


def differences(name: str, markdown: str, images: dict[str, bytes]) -> list[str]:
    """How the committed page of notebook `name` differs from this rendering of it (empty: fresh)."""
    page, rendered = PAGES / f"{name}.md", RENDERED / f"{name}.md"
    if not rendered.exists() or not page.exists():
        return [f"{page.relative_to(ROOT)} or {rendered.relative_to(ROOT)} is missing"]
    out = []
    if page.read_text() != PAGE.format(name=name):
        out.append(f"{page.relative_to(ROOT)} is not the page this script writes")
    out += [f"{rendered.relative_to(ROOT)}, {d}" for d in text_differences(rendered.read_text(), markdown)]
    committed = {p.name for p in IMAGES.glob(f"{name}-*.png")}
    if committed != set(images):
        out.append(f"figures committed {sorted(committed)}, drawn now {sorted(images)}")
    for file in sorted(committed & set(images)):
        d = image_differences((IMAGES / file).read_bytes(), images[file])
        if d:
            out.append(f"docs/images/notebooks/{file}: {d}")
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
            markdown, images = render(nbformat.read(out, as_version=4), path.stem)
            write(path.stem, markdown, images)
            print(f"{path.name}: {got['seconds']:.0f} s, {len(images)} figures -> "
                  f"{(PAGES / path.name).with_suffix('.md').relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
