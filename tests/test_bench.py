"""The benchmark suite runs (quick mode: tiny sizes, seconds), so it cannot rot. Speed is never asserted here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_mode_runs(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--no-torch", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    for row in ("optim eager", "optim jit", "optax", "probe"):
        assert f"| {row} |" in text, row
    assert (tmp_path / "RESULTS.json").exists()
