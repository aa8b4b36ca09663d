"""The main job (`./dev demo` = examples/train_gpt2.py) runs: a few steps of it, as a user would.

Its default budget is 80% of the bf16 parameter bytes with activation checkpointing,
and a profiler attached: every part of the data path, the memory probe measuring
all along. A regression anywhere there (the warm-up asking for a bigger budget than
the run needs, say) fails the README's first command; this catches it first.

Also what a new user meets first: ``--quick`` trains (with eviction) and prints how
to make a second profile and compare the two, and that second run works; ``--help``
gives every flag's default; a budget too small stops without a traceback and names
the ``--budget-fraction`` that works, and that one does.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import chunkstar_profiler

from tests.examples import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "train_gpt2.py"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=cwd)


def _row(out: str, label: str) -> str:
    """The summary table's row for ``label`` (without the label)."""
    found = [line.strip()[len(label) :] for line in out.splitlines() if line.strip().startswith(label + " ")]
    assert found, f"no '{label}' row in:\n{out[-3000:]}"
    return found[0].strip()


def _mib(text: str) -> float:
    m = re.match(r"([\d,.]+) (MiB|GiB)", text)
    assert m, text
    return float(m.group(1).replace(",", "")) * (1024 if m.group(2) == "GiB" else 1)


def test_the_demo_trains_under_its_budget_and_writes_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "demo.csprof"
    proc = _run("--steps", "4", "--profile", str(profile), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "summary" in out, out[-2000:]
    assert profile.exists() and profile.stat().st_size > 0

    # figures with units, not dicts
    assert "{" not in out.split("summary", 1)[1], out[-3000:]
    budget, peak = _mib(_row(out, "device budget")), _mib(_row(out, "device chunk peak"))
    assert 0 < peak <= budget, (budget, peak)
    for way in ("to the device", "to the host"):
        row = _row(out, way)
        assert _mib(row) > 0 and re.search(r"in [\d,]+ chunk moves", row), row
    assert re.match(r"[\d.]+ s/step", _row(out, "time")), _row(out, "time")

    # bytes/param above 14 is padding, and the padding row says how much
    per_param = float(_row(out, "bytes/param").split()[0])
    assert per_param > 14 and "padding" in _row(out, "bytes/param")
    n_params = float(re.search(r"GPT-2 ([\d.]+)M params", out).group(1)) * 1e6  # type: ignore[union-attr]
    padding = _mib(_row(out, "padding"))
    assert abs(padding - (per_param - 14) * n_params / 2**20) < 0.05 * padding + 0.2, (padding, per_param, n_params)

    # the profile commands end the output: view it, then compare it with a second run's
    lines = out.rstrip().splitlines()
    view = next(line for line in lines if line.strip().startswith("view:"))
    assert view.split("view:", 1)[1].strip() == f"chunkstar-profile view {profile}", view
    compare = next(line for line in lines if line.strip().startswith("compare:"))
    m = re.search(r"rerun with --budget-fraction (\S+) --profile (\S+), then chunkstar-profile view (\S+) --compare (\S+)$", compare)
    assert m and m.group(3) == str(profile) and m.group(2) == m.group(4) != str(profile), compare
    assert float(m.group(1)) != 0.8


def test_quick_trains_with_eviction_and_its_comparison_run_works(tmp_path: Path) -> None:
    profile = tmp_path / "quick.csprof"
    proc = _run("--quick", "--profile", str(profile), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "30 steps" in out and "6 layers, hidden 384, vocab 4096" in out, out[:500]
    # the virtual device's meter (every step measured: the suite sets CHUNKSTAR_STRICT_DEVICE=1) never
    # saw more held than the budget: chunks until really freed beside activations, the evaluation
    # before training included
    assert "OVER THE BUDGET" not in _row(out, "device peak"), _row(out, "device peak")
    assert 0 < _mib(_row(out, "device peak")) <= _mib(_row(out, "device budget")), out[-2000:]
    assert int(re.search(r"in ([\d,]+) chunk moves", _row(out, "to the host")).group(1).replace(",", "")) > 0  # type: ignore[union-attr]
    m = re.search(r"held-out loss\s+(\S+) before training -> (\S+) after", out)
    assert m and float(m.group(2)) < float(m.group(1)) - 1.0, out[-2000:]

    # the printed rerun makes the second profile (shortened here), and both load
    rerun = re.search(r"\(the rerun: (.+)\)$", out.rstrip().splitlines()[-1])
    assert rerun, out[-1000:]
    argv = shlex.split(rerun.group(1))
    assert argv[:2] == ["python", "examples/train_gpt2.py"] and "--quick" in argv, argv
    other = Path(argv[argv.index("--profile") + 1])
    second = subprocess.run([sys.executable, *argv[1:], "--steps", "3"], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = chunkstar_profiler.load(str(profile)), chunkstar_profiler.load(str(other))
    assert len(a.moves) > 0 and len(b.moves) > 0


def test_help_documents_every_flag_with_its_default(tmp_path: Path) -> None:
    proc = _run("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    options = proc.stdout.split("options:", 1)[1]
    # one entry per flag: from a line starting with "  --" to the next such line
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    flags = [e for e in entries if not e.lstrip().startswith("-h")]
    assert len(flags) >= 14, entries
    for e in flags:
        assert "(default:" in " ".join(e.split()), e


def test_a_budget_too_small_names_the_fraction_that_works(tmp_path: Path) -> None:
    """The report: `--budget-fraction 0.6` crashed with a traceback whose advice (lower
    default_chunk_size) could not help: the tied embedding has a chunk of its own."""
    proc = _run("--budget-fraction", "0.6", "--steps", "3", "--profile", "", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    assert "in training step 1" in err and "'lm_head' (fwd)" in err, err[-3000:]
    assert "--chunk-size" not in err and "lower 'default_chunk_size'" not in err, err[-3000:]
    m = re.search(r"rerun with --budget-fraction ([\d.]+) \(or more\)", err)
    assert m, err[-3000:]
    fraction = m.group(1)
    assert 0.6 < float(fraction) < 0.8, fraction
    again = _run("--budget-fraction", fraction, "--steps", "3", "--profile", "", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "summary" in again.stdout
