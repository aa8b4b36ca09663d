"""Fixtures of the dashboard tests: the source roots and real profiles.

The profiles come from real chunkstar training runs of the tiny GPT-2 the core
tests use, under a device budget that forces evictions, recorded by
``chunkstar_profiler.Profiler``: what the dashboard shows a user.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packages" / "dashboard"
"""``chunkstar_dashboard``'s source root (found here even where the checkout was installed before it existed)."""
APP = DASHBOARD / "chunkstar_dashboard" / "app.py"
"""The Streamlit script; its pages are ``views/*.py`` beside it."""
ENTRY = REPO / "dashboards" / "app.py"
"""The checkout's thin entry, for ``streamlit run dashboards/app.py``."""
BENCH = REPO / "packages" / "bench"
"""``chunkstar_bench``'s source root: the Benchmarks page reads results through it."""
SOURCE_ROOTS = (DASHBOARD, BENCH, REPO / "packages" / "profiler", REPO / "packages" / "core")
for _path in SOURCE_ROOTS[:2]:
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def source_pythonpath() -> str:
    """``PYTHONPATH`` for a child process that runs the checkout's code (the app served by a real Streamlit)."""
    return os.pathsep.join([*(str(p) for p in SOURCE_ROOTS), *filter(None, [os.environ.get("PYTHONPATH", "")])])


def _record(path: Path, *, chunk_size: int, steps: int = 3, disk_dir: Path | None = None) -> Path:
    """With ``disk_dir``, the optimizer state lives in chunk files there (the disk tier)."""
    import chunkstar
    import chunkstar_profiler
    import torch

    from core._models import CASES, engine_config, eviction_budget

    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), torch.float32)
    extra = {} if disk_dir is None else {"disk": {"path": str(disk_dir)}}
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config(budget=budget, chunk_size=chunk_size, **extra)
    )
    try:
        with chunkstar_profiler.Profiler(engine) as prof:
            for step in range(steps):
                loss = case.loss(engine, case.batch(step), torch.float32)
                engine.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        prof.save(str(path))
    finally:
        engine.close()
    return path


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step profile, 4096-element chunks, budget 60% of the parameter bytes."""
    return _record(tmp_path_factory.mktemp("profiles") / "chunk4096.csprof", chunk_size=4096)


@pytest.fixture(scope="session")
def other_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run with 8192-element chunks, to compare against."""
    return _record(tmp_path_factory.mktemp("profiles") / "chunk8192.csprof", chunk_size=8192)


@pytest.fixture(scope="session")
def disk_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4096-element run with the disk tier: master and Adam state in chunk files, staged through host buffers."""
    return _record(
        tmp_path_factory.mktemp("profiles") / "disk4096.csprof", chunk_size=4096, disk_dir=tmp_path_factory.mktemp("disk")
    )


@pytest.fixture(scope="session")
def offload_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step profile of a run that offloads its blocks' saved activations (``"activations": {"policy": "offload"}``):
    a two-block GPT-2 256 wide on 2 x 256 tokens, whose saved storages (1.5-2 MiB) pass the offload's 1 MiB minimum,
    under a budget that moves chunks too."""
    import chunkstar
    import chunkstar_profiler
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from core._models import engine_config, gpt2_batch, hf_loss

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=256, n_embd=256, n_layer=2, n_head=4, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip

    path = tmp_path_factory.mktemp("profiles") / "offload.csprof"
    cfg = engine_config(budget="40MB", chunk_size=1 << 16, activations={"policy": "offload"})
    engine, optimizer = chunkstar.initialize_engine(model_func=gpt2, local_rank=0, config=cfg)
    try:
        with chunkstar_profiler.Profiler(engine) as prof:
            for step in range(3):
                engine.backward(hf_loss(engine, gpt2_batch(step, batch=2, seq=256), torch.float32))
                optimizer.step()
                optimizer.zero_grad()
        prof.save(str(path))
    finally:
        engine.close()
    return path


@pytest.fixture(scope="session")
def predicted_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A predicted profile: rank 0's step of a 2-rank dry run of a tiny GPT-2 (3 layers) on the meta device,
    under a budget that forces moves, on the time model's clock for the paper's 8 x A100 node
    (``chunkstar_profiler.predicted``, as ``tests/profiler/test_predicted.py`` builds it)."""
    import chunkstar
    import torch
    from chunkstar_profiler.predicted import write_predicted_profile
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2() -> torch.nn.Module:
        return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=64))

    ids = torch.zeros(2, 32, dtype=torch.long)
    cfg = {"device_memory_budget": "4MB", "default_chunk_size": 40000, "bf16": {"enabled": True}}
    report = chunkstar.dry_run(gpt2, cfg, {"input_ids": ids, "labels": ids}, world_size=2, hardware="a100x8_1tb")
    return Path(write_predicted_profile(report, tmp_path_factory.mktemp("profiles") / "predicted.csprof", rank=0))


@pytest.fixture(scope="session")
def bad_profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "not_a_profile.csprof"
    path.write_bytes(b"this is not a chunkstar profile\n")
    return path


@pytest.fixture(scope="session")
def bench_db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results SQLite of nightly and max-scale runs (``_bench_db``), one regression in it."""
    from ._bench_db import populate

    return populate(tmp_path_factory.mktemp("bench") / "nightly.sqlite")
