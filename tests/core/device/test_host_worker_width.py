"""The host worker's width with several processes per node (Note [the rank's share of the cores]
in chunkstar/device/threads.py; issue 30, item 7).

Under ``torchrun`` with several processes per node, torch runs one thread per rank
(``OMP_NUM_THREADS=1``), and host Adam ran on one core per rank. The worker now takes the
rank's share of the CPUs the process may run on (``os.sched_getaffinity`` / ``LOCAL_WORLD_SIZE``)
and ``engine.stats()["host_worker_threads"]`` says how wide it runs. No GPU here: the CUDA
branch runs with ``torch.cuda.set_device`` monkeypatched (the worker sets its device first).
"""

from __future__ import annotations

import os

import pytest
import torch

import chunkstar
from chunkstar.device import threads as device_threads
from chunkstar.device.copy_engine import HostWorker, InlineWorker
from chunkstar.device.threads import host_worker_width, processes_on_node, rank_share_of_cores
from chunkstar.memory.tracer import TracePhase

from tests.core._models import CASES, engine_config, train_engine

needs_omp = pytest.mark.skipif(
    device_threads._OMP_SET_NUM_THREADS is None, reason="torch without a global OpenMP runtime: no width to set"
)


def test_the_share_is_the_cpus_divided_among_the_nodes_processes() -> None:
    assert rank_share_of_cores({"LOCAL_WORLD_SIZE": "4"}, cpus=16) == 4
    assert rank_share_of_cores({"LOCAL_WORLD_SIZE": "3"}, cpus=16) == 5
    assert rank_share_of_cores({"LOCAL_WORLD_SIZE": "8"}, cpus=4) == 1  # never 0
    assert rank_share_of_cores({}, cpus=16) == 16
    assert rank_share_of_cores({"LOCAL_WORLD_SIZE": "two"}, cpus=16) == 16  # unreadable: one process per node
    # alone on its node the worker keeps torch's width (which the user may have set)
    assert host_worker_width({"LOCAL_WORLD_SIZE": "1"}, cpus=16) == torch.get_num_threads()
    assert host_worker_width({}, cpus=16) == torch.get_num_threads()
    assert host_worker_width({"LOCAL_WORLD_SIZE": "4"}, cpus=16) == 4


def test_the_share_reads_the_process_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert rank_share_of_cores() == 4 and host_worker_width() == 4


@pytest.fixture
def two_ranks_on_eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun --nproc-per-node 2 gives each rank on an 8-CPU node: LOCAL_WORLD_SIZE=2."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


@needs_omp
def test_on_cuda_the_worker_runs_at_the_ranks_share_from_its_first_job(
    two_ranks_on_eight_cpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    worker = HostWorker(device=torch.device("cuda", 0))
    widths: list[int] = []
    worker.submit(lambda: widths.append(torch.get_num_threads())).wait()
    worker.close()
    assert worker.threads == 4 and widths == [4]


@needs_omp
def test_on_the_cpu_device_the_worker_widens_to_the_ranks_share(two_ranks_on_eight_cpus: None) -> None:
    worker = HostWorker(device=torch.device("cpu"))
    widths: list[int] = []
    worker.submit(lambda: widths.append(torch.get_num_threads())).wait()
    assert worker.threads == 1 and widths == [1]  # narrow until the schedule gives it updates (Note [one OpenMP team])
    worker.widen()
    worker.submit(lambda: widths.append(torch.get_num_threads())).wait()
    worker.close()
    assert worker.threads == 4 and widths == [1, 4]


def test_the_serial_path_reports_the_compute_threads_width() -> None:
    assert InlineWorker().threads == torch.get_num_threads()


def test_engine_stats_say_how_wide_the_host_worker_runs(two_ranks_on_eight_cpus: None) -> None:
    case = CASES["mlp"]
    config = {**engine_config("fp32", budget="1GB"), "hybrid_adam": False}  # every update on the host worker
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    train_engine(engine, optimizer, case, 1)
    assert engine.stats()["host_worker_threads"] == 1  # warm-up: narrow
    train_engine(engine, optimizer, case, range(1, 4))
    assert engine.schedule.phase is TracePhase.FROZEN
    assert engine.stats()["host_worker_threads"] == 4
    engine.close()


def test_the_processes_on_a_node_come_from_whichever_launcher_says() -> None:
    assert processes_on_node({}) == 1  # no launcher says: one process per node
    assert processes_on_node({"LOCAL_WORLD_SIZE": "4"}) == 4  # torchrun, accelerate launch
    assert processes_on_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 8  # Open MPI
    assert processes_on_node({"MPI_LOCALNRANKS": "2"}) == 2  # MPICH, Intel MPI
    assert processes_on_node({"SLURM_NTASKS_PER_NODE": "3"}) == 3  # srun --ntasks-per-node
    assert processes_on_node({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}) == 2  # torchrun's first
    assert processes_on_node({"LOCAL_WORLD_SIZE": "two"}) == 1
    assert rank_share_of_cores({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, cpus=16) == 4
