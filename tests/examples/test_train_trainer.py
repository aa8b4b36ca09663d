"""examples/train_trainer.py (ChunkstarTrainer on a tiny GPT-2) runs as a user would run it:
a few steps with a checkpoint, the saved model reloaded by from_pretrained and evaluated by
the plain Trainer to the same loss, and, after an "interruption" (the last checkpoint and
the final model removed), the same command with --resume ending at the same loss."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.examples import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_trainer.py"


def _run(*argv: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _after(out: str) -> str:
    m = re.search(r"held-out loss: \S+ before, (\S+) after 6 steps", out)
    assert m, out[-2000:]
    return m.group(1)


def test_the_trainer_example_trains_saves_reloads_and_resumes(tmp_path: Path) -> None:
    # a smaller model than the example's default, under a budget that still evicts: quick
    small = ["--n-layer", "2", "--n-embd", "128", "--budget", "3.5MB"]
    flags = ["--steps", "6", "--save-steps", "3", "--eval-steps", "3", "--output-dir", "run", *small]
    out = _run(*flags, cwd=tmp_path)
    after = _after(out)
    assert f"from_pretrained + the plain Trainer: held-out loss {after}" in out, out[-2000:]
    moves = re.search(r"([\d,]+) evictions", out)
    assert moves and int(moves.group(1).replace(",", "")) > 0, out[-2000:]
    run = tmp_path / "run"
    assert (run / "final" / "model.safetensors").exists() and (run / "checkpoint-3" / "chunkstar").is_dir()

    shutil.rmtree(run / "checkpoint-6")  # interrupted between the two checkpoints
    shutil.rmtree(run / "final")
    again = _run(*flags, "--resume", cwd=tmp_path)
    assert _after(again) == after


def test_the_trainer_example_documents_its_flags() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--steps", "--batch", "--grad-accum", "--budget", "--bf16", "--lora", "--output-dir", "--save-steps", "--resume"):
        assert flag in proc.stdout, flag
