"""Run each script in examples/ in a subprocess with small flags, as a user would, and check what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str, timeout: int = 900) -> str:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("XLA_FLAGS", None)           # each script sets the device count it needs
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_train_tied_lm_tiny_then_resume(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    out = run("train_tied_lm.py", "--steps", "20", "--size", "tiny", "--sample", "40", "--out", str(tmp_path))
    assert "tie held" in out and "{'embed': ('unembed',)}" in out
    assert "with the EMA of the parameters" in out and "gradient norm (each parameter once" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000
    with np.load(tmp_path / "checkpoint.npz", allow_pickle=False) as ckpt:   # an optim.save file, no pickle
        assert {"meta", "check", "data"} <= set(ckpt.files)
    losses = json.loads((tmp_path / "checkpoint.json").read_text())["losses"]
    assert len(losses) == 20
    first = float(np.mean(losses[:5]))

    out = run("train_tied_lm.py", "--steps", "30", "--size", "tiny", "--sample", "20", "--out", str(tmp_path),
              "--resume")
    assert "resumed from" in out and "at step 20" in out and "steps 20 -> 30" in out
    losses = json.loads((tmp_path / "checkpoint.json").read_text())["losses"]
    assert len(losses) == 30 and float(np.mean(losses[-5:])) < first    # it learns, and carries on learning


def test_train_tied_lm_data_parallel(tmp_path):
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run("train_tied_lm.py", "--steps", "8", "--size", "tiny", "--devices", "2", "--data", str(text),
              "--sample", "10", "--out", str(tmp_path / "run"))
    assert "devices: 2" in out and "tie held" in out


def test_finetune_freeze():
    out = run("finetune_freeze.py", "--steps", "20", "--pretrain-steps", "50")
    assert "stage + all layers" in out and "gradual unfreezing" in out


def test_data_parallel():
    out = run("data_parallel.py", "--steps", "20")
    assert "8 devices" in out and "the tie held everywhere" in out
