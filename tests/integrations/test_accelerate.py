"""chunkstar inside an Accelerate loop, launched by ``accelerate launch`` (docs/trainer.md).

Accelerate has no hook for another engine to own the model: the honest path is Accelerate
as the launcher and for the data, the engine for the model, optimizer and backward
(tests/integrations/_accelerate_worker.py). Two processes over batches of 2 must train as
one plain-PyTorch process over batches of 4.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.core._models import assert_losses_close  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(out: Path, kind: str, batch: int, processes: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    module = ["-m", "tests.integrations._accelerate_worker", str(out), kind, str(batch)]
    if processes == 1:
        cmd = [sys.executable, *module]
    else:
        launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
        cmd = [
            launcher, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), *module,
        ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = out / "result.json"
    return dict(json.loads(result.read_text())) if result.exists() else {}


def test_two_processes_under_accelerate_launch_equal_one_plain_process(tmp_path: Path) -> None:
    want = _run(tmp_path / "plain", "plain", 4, 1)
    got = _run(tmp_path / "chunkstar", "chunkstar", 2, 2)
    assert got["processes"] == 2
    assert int(got["moves"]) > 0, "the budget should evict chunks"  # type: ignore[call-overload]
    assert_losses_close(got["losses"], want["losses"], 1e-5, "accelerate launch, 2 processes")  # type: ignore[arg-type]
    mine = load_file(tmp_path / "chunkstar" / "weights.safetensors")
    plain = load_file(tmp_path / "plain" / "weights.safetensors")
    assert mine.keys() == plain.keys()
    for k in plain:
        torch.testing.assert_close(mine[k], plain[k], rtol=0, atol=1e-5, msg=k)


def test_the_model_given_to_prepare_is_refused_naming_the_wrapper(tmp_path: Path) -> None:
    """prepare(model) wraps it in DistributedDataParallel, which reads every parameter as it
    is built: each process refuses with a message that says to leave the model unwrapped."""
    _run(tmp_path, "wrapped", 2, 2)
    for rank in range(2):
        refused = (tmp_path / f"refused{rank}.txt").read_text()
        assert "kept by another rank" in refused and "prepare(model)" in refused, refused
