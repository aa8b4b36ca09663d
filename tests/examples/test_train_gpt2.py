"""The main job (`./dev demo` = examples/train_gpt2.py) runs: a few steps of it, as a user would.

Its default budget is 80% of the bf16 parameter bytes with activation checkpointing,
and a profiler attached: every part of the data path, the memory probe measuring
all along. A regression anywhere there (the warm-up asking for a bigger budget than
the run needs, say) fails the README's first command; this catches it first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_trains_under_its_budget_and_writes_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "demo.csprof"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt2.py"), "--steps", "4", "--profile", str(profile)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary" in proc.stdout and "chunk moves" in proc.stdout, proc.stdout[-2000:]
    assert profile.exists() and profile.stat().st_size > 0
