"""A results database as the nightly job leaves one: written through ``ResultsDB.append`` with real ``RunRecord``s.

Seven nightly commits of three systems on two CPU models (throughput with a
little noise; chunkstar on ``cpu-small`` drops 30% and its peak host memory
rises 25% at the last commit, a regression the page must flag), and a
max-scale ladder per system ending in an out-of-memory run.
"""

from __future__ import annotations

from pathlib import Path

from chunkstar_bench import zoo
from chunkstar_bench.results import ResultsDB
from chunkstar_bench.runner import RunRecord, RunSpec

HARDWARE = "cpu-2core"
COMMITS = [f"{i:x}" * 8 + f"{i:02d}" * 16 for i in range(1, 8)]
"""Seven 40-character fake commit ids, oldest first."""
BASE_TOKENS = {("chunkstar", "cpu-tiny"): 9000.0, ("chunkstar", "cpu-small"): 4000.0, ("deepspeed", "cpu-tiny"): 5000.0,
               ("deepspeed", "cpu-small"): 2500.0, ("pytorch", "cpu-tiny"): 9500.0, ("pytorch", "cpu-small"): 4200.0}  # fmt: skip
REGRESSED = ("chunkstar", "cpu-small")
MAXSCALE_OK = {"chunkstar": "cpu-600m", "deepspeed": "cpu-355m"}
"""The largest model each system's max-scale ladder trained; the next one ran out of memory."""


def _record(system: str, model: str, *, status: str, day: int, commit: str, tokens: float | None, host: int | None, batch: int = 4) -> RunRecord:
    spec = RunSpec(system=system, model=model, batch=batch, steps=3, warmup=1, hardware=HARDWARE)  # type: ignore[arg-type]
    n = zoo.n_params(zoo.get(model))
    seq = spec.seq
    step = batch * seq / tokens if tokens else None
    return RunRecord(
        spec=spec, status=status, message="" if status == "ok" else "host memory cap exceeded",  # type: ignore[arg-type]
        step_time_s=step, tokens_per_s=tokens,
        tflops_per_gpu_patrickstar=8 * n * batch * seq / step / 1e12 if step else None,
        peak_device_bytes=host // 2 if host else None, peak_host_bytes=host, n_params=n,
        created_utc=f"2025-03-{day:02d}T02:00:00Z", git_commit=commit, host="ci-runner",
        versions={"torch": "2.13.0"},
    )  # fmt: skip


def populate(path: Path) -> Path:
    db = ResultsDB(path)
    for i, commit in enumerate(COMMITS):
        last = i == len(COMMITS) - 1
        for (system, model), base in BASE_TOKENS.items():
            tokens = base * (1 + 0.02 * ((i * 7 + len(system)) % 3 - 1))
            host = (600 + 40 * (model == "cpu-small")) * 2**20
            if last and (system, model) == REGRESSED:
                tokens, host = base * 0.7, int(host * 1.25)
            db.append(_record(system, model, status="ok", day=i + 1, commit=commit, tokens=tokens, host=host), suite="nightly")
    ladder = zoo.cpu_ladder()
    for system, top in MAXSCALE_OK.items():
        for model in ladder[: ladder.index(top) + 2]:
            status = "oom" if ladder.index(model) > ladder.index(top) else "ok"
            tflops = {"chunkstar": 0.45, "deepspeed": 0.3}[system]  # about flat across sizes, as on a real node
            tokens = tflops * 1e12 / (8 * zoo.n_params(zoo.get(model))) if status == "ok" else None
            host = 14 * zoo.n_params(zoo.get(model)) if status == "ok" else None
            db.append(_record(system, model, status=status, day=8, commit=COMMITS[-1], tokens=tokens, host=host, batch=1), suite="maxscale")
    return path
