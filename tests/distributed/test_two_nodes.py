"""Two "nodes" on this machine (issue 29): two torchrun launchers of two gloo processes each,
``--nnodes 2 --node_rank R --rdzv_backend c10d``, as docs/distributed.md promises.

- the four ranks train GPT-2 equal to one process on the full batch (global and local
  ranks as torchrun gives them: ranks 0-3, local ranks 0, 1 on each node);
- they save a checkpoint into one shared folder after each step (every rank its shard,
  rank 0 the ``latest``);
- node 1 is lost after step 3's save: node 0's launcher ends with a failure, not a hang;
  both nodes launched again resume from ``latest`` bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_nodes_worker.py")
STEPS = 5
DIE_AFTER = 2  # node 1 is lost once step 2 (the third) is saved
TIMEOUT = 300


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _launch(out: Path, nodes: int, *extra: str) -> list[subprocess.CompletedProcess[str]]:
    """One torchrun launcher per node (2 processes each; one process when ``nodes`` is 0),
    run at once; each one's result."""
    if nodes == 0:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        return [subprocess.run([*cmd, str(WORKER), str(out), str(STEPS), *extra], capture_output=True, text=True,
                               timeout=TIMEOUT, env=_env(), cwd=REPO)]  # fmt: skip
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "2",
             "--node_rank", str(r), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--max_restarts", "0", str(WORKER), str(out), str(STEPS), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
        )  # fmt: skip
        for r in range(nodes)
    ]
    done = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)  # a launcher still running at the deadline: a hang
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def _ranks(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_nodes_train_save_lose_a_node_and_resume(tmp_path: Path) -> None:
    (one,) = _launch(tmp_path / "one", 0)
    assert one.returncode == 0, one.stderr[-3000:]
    (single,) = _ranks(tmp_path / "one", 1)

    # two nodes, uninterrupted: equal to one process on the full batch
    results = _launch(tmp_path / "two", 2)
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    ranks = _ranks(tmp_path / "two", 4)
    assert [(r["rank"], r["node"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(r["world"] == r["stats_world"] == 4 and r["stats_rank"] == r["rank"] for r in ranks)
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)  # the mean over ranks, the same on every rank
    for a, b in zip(ranks[0]["losses"], single["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (ranks[0]["losses"], single["losses"])
    ckpt = tmp_path / "two" / "ckpt"
    published = ckpt / (ckpt / "latest").read_text().strip()
    assert sorted(os.listdir(published)) == [f"rank{r}-of-4.safetensors" for r in range(4)]

    # node 1 is lost after step DIE_AFTER's save: node 0's launcher fails (it does not hang)
    lost = _launch(tmp_path / "lost", 2, "--die-after", str(DIE_AFTER))
    assert all(r.returncode != 0 for r in lost), [r.returncode for r in lost]
    assert not list((tmp_path / "lost").glob("rank*.json"))  # no rank finished
    # both nodes again, from the last checkpoint: bit for bit the uninterrupted run's steps
    back = _launch(tmp_path / "lost", 2, "--resume")
    assert all(r.returncode == 0 for r in back), [r.stderr[-3000:] for r in back]
    resumed = _ranks(tmp_path / "lost", 4)
    assert all(r["start"] == DIE_AFTER + 1 for r in resumed)
    assert all(r["losses"] == ranks[0]["losses"][DIE_AFTER + 1 :] for r in resumed)
