"""``deepspeed-nvme`` (ZeRO-Infinity): its config, its fail-fast reason, and the runner's swap folder."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from chunkstar_bench.cli import main
from chunkstar_bench.harness import ADAMW
from chunkstar_bench.report import maxscale_table
from chunkstar_bench.results import ResultsDB
from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.systems.deepspeed import (
    _NVME_SUB_GROUP_ELEMENTS,
    largest_param_numel,
    require_async_io,
    zero3_offload_config,
)
from chunkstar_bench.zoo import build_hf, get, n_params
from tests.bench._records import record


def _config(**kw: Any) -> dict[str, Any]:
    return zero3_offload_config(batch=2, adamw=ADAMW, pin_memory=False, ds_cpu_adam=True, **kw)


def test_cpu_offload_config_has_no_disk_keys() -> None:
    config = _config()
    zero = config["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert "aio" not in config and "sub_group_size" not in zero


def test_nvme_config_swaps_the_optimizer_state_to_the_folder() -> None:
    config = _config(nvme_path="/disk/run1")
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/disk/run1", "pin_memory": False, "buffer_count": 4}
    assert zero["offload_param"]["device"] == "cpu"  # params stay on the host unless asked
    assert zero["sub_group_size"] == _NVME_SUB_GROUP_ELEMENTS < 10**9  # DeepSpeed's default would need 16 GB of buffers
    assert set(config["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"}


def test_nvme_params_buffers_hold_the_largest_parameter_and_sub_group() -> None:
    model = get("cpu-tiny")
    largest = max(p.numel() for p in build_hf(model).parameters())
    assert largest_param_numel(model) == largest
    zero = _config(nvme_path="/d", nvme_params=True, largest_param_numel=largest)["zero_optimization"]
    param = zero["offload_param"]
    assert param["device"] == "nvme" and param["nvme_path"] == "/d" and param["max_in_cpu"] == 0
    # a sub-group is cut after the parameter that takes it past sub_group_size
    assert param["buffer_size"] >= zero["sub_group_size"] + largest
    assert zero["stage3_prefetch_bucket_size"] == 0 and zero["stage3_max_reuse_distance"] == 0
    with pytest.raises(ValueError, match="largest_param_numel"):
        _config(nvme_path="/d", nvme_params=True)


class _Builder:
    def __init__(self, compatible: bool, error: Exception | None = None) -> None:
        self.compatible, self.error = compatible, error

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.compatible

    def load(self, verbose: bool = False) -> Any:
        if self.error is not None:
            raise self.error
        return os  # any module with a __file__


def test_missing_libaio_fails_fast_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match="libaio's headers and library were not found .*apt-get install libaio-dev"):
        require_async_io(_Builder(compatible=False))
    with pytest.raises(RuntimeError, match="failed to build or load: OSError: libaio.so.1: cannot open"):
        require_async_io(_Builder(compatible=True, error=OSError("libaio.so.1: cannot open\nmore")))
    assert require_async_io(_Builder(compatible=True)) == os.__file__


def test_disk_options_belong_to_the_disk_system() -> None:
    spec = RunSpec(system="deepspeed-nvme", model="cpu-tiny", batch=1, steps=1, warmup=0, disk_dir="/x", nvme_params=True)
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="disk_dir is only used by chunkstar-disk, deepspeed-nvme"):
        RunSpec(system="deepspeed", model="cpu-tiny", batch=1, steps=1, warmup=0, disk_dir="/x")
    with pytest.raises(ValueError, match="nvme_params is only used by chunkstar-disk, deepspeed-nvme"):
        RunSpec(system="deepspeed", model="cpu-tiny", batch=1, steps=1, warmup=0, nvme_params=True)
    with pytest.raises(ValueError, match="chunkstar_staging is only used by chunkstar-disk"):
        RunSpec(system="chunkstar", model="cpu-tiny", batch=1, steps=1, warmup=0, chunkstar_staging="1GB")
    ok = RunSpec(
        system="chunkstar-disk", model="cpu-tiny", batch=1, steps=1, warmup=0, disk_dir="/x", chunkstar_staging="1GB",
        nvme_params=True,  # chunkstar-disk's param list on disk
    )
    assert RunSpec.from_json(ok.to_json()) == ok


def _nvme(tmp_path: Path, **kw: Any) -> RunSpec:
    return RunSpec(system="deepspeed-nvme", model="cpu-tiny", batch=1, seq_len=32, steps=1, warmup=0,
                   disk_dir=str(tmp_path / "disk"), **kw)  # fmt: skip


def test_swap_folder_is_removed_even_when_the_watchdog_kills_the_run(tmp_path: Path) -> None:
    r = run(_nvme(tmp_path, host_mem_cap_bytes=100 * 2**20), timeout_s=120, echo=False)
    assert r.status == "oom"
    assert Path(r.details["disk_dir"]).parent == tmp_path / "disk"
    assert list((tmp_path / "disk").iterdir()) == []  # the run's own folder is gone
    assert isinstance(r.details["disk_bytes"], int)


def test_a_swap_folder_that_cannot_be_made_is_an_error_record(tmp_path: Path) -> None:
    (tmp_path / "disk").write_text("a file, not a folder")
    r = run(_nvme(tmp_path), timeout_s=120, echo=False)
    assert r.status == "error" and r.message.startswith(f"cannot make a swap folder under {tmp_path / 'disk'}")


def test_max_scale_swaps_beside_the_db_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs: list[RunSpec] = []

    def fake(spec: RunSpec, timeout_s: float, *, echo: bool = True) -> RunRecord:
        specs.append(spec)
        return dataclasses.replace(record(spec.system, spec.model), spec=spec)

    monkeypatch.setattr("chunkstar_bench.maxscale.run", fake)
    db = str(tmp_path / "r.sqlite")
    assert main(["max-scale", "--system", "deepspeed-nvme", "--cap", "1GiB", "--db", db, "--models", "cpu-tiny"]) == 0
    assert specs[-1].disk_dir == str(tmp_path) and not specs[-1].nvme_params
    assert main(["max-scale", "--system", "deepspeed-nvme", "--cap", "1GiB", "--db", db, "--models", "cpu-tiny",
                 "--disk-dir", str(tmp_path / "d"), "--nvme-params"]) == 0  # fmt: skip
    assert specs[-1].disk_dir == str(tmp_path / "d") and specs[-1].nvme_params
    assert main(["max-scale", "--system", "deepspeed", "--cap", "1GiB", "--db", db, "--disk-dir", str(tmp_path)]) == 2


def test_maxscale_table_keeps_the_params_on_disk_variant_apart(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    for model, status, on_disk in (("cpu-430m", "ok", False), ("cpu-500m", "oom", False), ("cpu-500m", "ok", True)):
        made = record("deepspeed-nvme", model, status=status, cap=8 * 2**30)
        db.append(dataclasses.replace(made, spec=dataclasses.replace(made.spec, nvme_params=on_disk)), suite="max-scale")
    rows = {line.split()[0]: line for line in maxscale_table(db.runs()).splitlines()[1:]}
    assert "cpu-430m (429.5M)" in rows["deepspeed-nvme"] and "cpu-500m (497.4M, oom)" in rows["deepspeed-nvme"]
    assert "cpu-500m (497.4M)" in rows["deepspeed-nvme+params"]


@pytest.mark.slow  # seconds once DeepSpeed's async I/O and CPU Adam ops are built; the first build takes minutes
@pytest.mark.parametrize("nvme_params", [False, True])
def test_one_step_swaps_the_optimizer_state_to_disk(tmp_path: Path, nvme_params: bool) -> None:
    r = run(_nvme(tmp_path, nvme_params=nvme_params), timeout_s=1200, echo=False)
    assert r.status == "ok", r.message
    config = r.details["deepspeed_config"]["zero_optimization"]
    assert config["offload_optimizer"]["nvme_path"] == r.details["disk_dir"]
    assert config["offload_param"]["device"] == ("nvme" if nvme_params else "cpu")
    # the fp32 master weights and Adam's two moments live in the swap files: 12 bytes per parameter at least
    assert r.details["disk_bytes"] >= 12 * n_params(get("cpu-tiny"))
    assert list((tmp_path / "disk").iterdir()) == []
