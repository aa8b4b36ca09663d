"""examples/train_lightning.py (ChunkstarStrategy on a tiny GPT-2) runs as a user would run
it: two epochs with a checkpoint folder after each, the last converted to one Lightning file
that load_from_checkpoint reads and Lightning's own strategy validates to the engine's loss,
and, after an "interruption" (the last epoch's checkpoint removed), the same command with
--resume going on from the first epoch's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples import HANG_GUARD_S

pytest.importorskip("lightning")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_lightning.py"


def _run(*argv: str, cwd: Path) -> str:
    # a run of its own: no rendezvous port or rank another test of this process left in the environment
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=cwd, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_lightning_example_trains_converts_reloads_and_resumes(tmp_path: Path) -> None:
    # a smaller model than the example's default, under a budget that still evicts: quick
    flags = ["--steps", "6", "--epoch-steps", "3", "--n-layer", "2", "--n-embd", "128", "--budget", "3.5MB",
             "--output-dir", "run"]  # fmt: skip
    out = _run(*flags, cwd=tmp_path)
    m = re.search(r"held-out loss (\S+) after 6 steps", out)
    assert m, out[-2000:]
    assert f"load_from_checkpoint + Lightning's own strategy: held-out loss {m.group(1)}" in out, out[-2000:]
    moves = re.search(r"([\d,]+) chunk moves to the device", out)
    assert moves and int(moves.group(1).replace(",", "")) > 0, out[-2000:]
    run = tmp_path / "run"
    for name in ("epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"):
        assert (run / name / "latest").is_file(), sorted(p.name for p in run.iterdir())
    assert (run / "final.ckpt").is_file()

    shutil.rmtree(run / "epoch=1-step=6.ckpt")  # interrupted in the second epoch
    shutil.rmtree(run / "last.ckpt")
    shutil.copytree(run / "epoch=0-step=3.ckpt", run / "last.ckpt")
    again = _run(*flags, "--resume", cwd=tmp_path)
    assert re.search(r"held-out loss \S+ after 6 steps", again), again[-2000:]


def test_the_lightning_example_documents_its_flags() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--steps", "--batch", "--grad-accum", "--precision", "--budget", "--devices", "--output-dir", "--resume"):
        assert flag in proc.stdout, flag
