"""The demo's fine-tuning path, as a user runs it: train and `--save-pretrained`, then
`--pretrained` from what was saved.

The saved directory must be an ordinary Hugging Face checkpoint (config.json and
safetensors, no pickle) that `GPT2LMHeadModel.from_pretrained` loads as fp32 with
nothing missing; the second run must build on the meta device, stream every tensor
from it and initialise nothing, and its held-out loss before training must be the
first run's after training (same weights, same batch: the same number).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import GPT2LMHeadModel

from tests.examples import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
# a model small enough to train in seconds, large enough that its chunks (not its activations) fill the budget
SHAPE = ["--n-layer", "4", "--n-embd", "256", "--vocab", "2048"]
COMMON = ["--seq", "64", "--profile", ""]


def _demo(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_gpt2.py"), *COMMON, *args],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary" in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


def _summary_line(out: str, label: str) -> str:
    found = [line for line in out.splitlines() if line.strip().startswith(label)]
    assert found, f"no '{label}' line in:\n{out[-2000:]}"
    return found[0]


def _held_out(out: str) -> tuple[str, str]:
    m = re.search(r"held-out loss\s+(\S+) before training -> (\S+) after", out)
    assert m, out[-2000:]
    return m.group(1), m.group(2)


def test_save_pretrained_then_fine_tune_from_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "gpt2-demo"
    first = _demo(tmp_path, *SHAPE, "--steps", "6", "--save-pretrained", str(ckpt))
    assert "built for real" in _summary_line(first, "model ")
    assert "saved model" in first

    # an ordinary Hugging Face checkpoint: config.json + safetensors, nothing pickled
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["config.json", "model.safetensors"], files
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert "lm_head.weight" not in saved  # tied to transformer.wte.weight, stored once
    model, info = GPT2LMHeadModel.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.transformer.wte.weight
    params = dict(model.named_parameters())
    for k, v in saved.items():
        assert torch.equal(params[k].detach(), v), k

    # fine-tune from it: built on the meta device, every tensor streamed, nothing initialised
    second = _demo(tmp_path, "--steps", "2", "--pretrained", str(ckpt))
    built = _summary_line(second, "model ")
    n_tensors = len(saved)
    assert "meta device" in built and f"{n_tensors} tensors" in built and "streamed from" in built, built
    assert "nothing initialised" in built and "not in the checkpoint" not in built, built
    # the weights came back: the held-out loss before fine-tuning is the saving run's after training
    assert _held_out(second)[0] == _held_out(first)[1], (first[-1500:], second[-1500:])
