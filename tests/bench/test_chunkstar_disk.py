"""The chunkstar-disk system of the bench: a meta-device build with the optimizer state in
chunk files under the run's own swap folder, its disk traffic in the record."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstar_bench.maxscale import peaks
from chunkstar_bench.runner import RunSpec, run


@pytest.mark.parametrize("params", [False, True], ids=["state", "state-and-params"])
def test_a_chunkstar_disk_run_records_its_disk_traffic_and_leaves_no_files(tmp_path: Path, params: bool) -> None:
    # params:1.5: the last backward moment (the tied embedding's, with its gradient temporaries)
    # needs 49 MiB here, past the activation estimate of params:0.6 (Note [the last moment's peak])
    spec = RunSpec(system="chunkstar-disk", model="cpu-tiny", batch=1, seq_len=32, steps=1, warmup=2,
                   disk_dir=str(tmp_path / "disk"), chunkstar_budget="params:1.5", nvme_params=params)  # fmt: skip
    r = run(spec, timeout_s=300, echo=False)
    assert r.status == "ok", r.message
    d = r.details
    stats = d["chunkstar_stats"]
    # the files hold what the parameters use, not the chunks' padding (Note [a file holds what a
    # chunk uses]): 12 bytes of state per parameter, and 2 of bf16 params when they are on disk
    state = 12 * stats["n_params"]
    assert stats["master_and_adam_bytes"] >= state > 0
    assert d["disk_file_bytes"] >= state + (2 * stats["n_params"] if params else 0)
    assert stats["params_on_disk"] is params  # the cap leaves cpu-tiny's params in host memory unless asked
    # every timed step reads and writes the whole state once
    assert d["disk_bytes_per_step"] >= 2 * state and d["disk_bytes_per_s"] > 0
    assert "disk" in peaks(r) and "GB/s" in peaks(r)
    assert list((tmp_path / "disk").iterdir()) == []  # the run's folder is gone
