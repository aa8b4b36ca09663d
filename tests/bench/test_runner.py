"""One run = one real subprocess: ok, oom under a host cap, error, and the spec's checks."""

from __future__ import annotations

import json

import pytest

from chunkstar_bench.child import _is_oom
from chunkstar_bench.runner import RunSpec, run
from chunkstar_bench.systems.chunkstar import DISK_PARAM_ROOM, chunkstar_budget_bytes
from chunkstar_bench.zoo import get, n_params


def _tiny(system: str, **kw: object) -> RunSpec:
    return RunSpec(system=system, model="cpu-tiny", batch=2, seq_len=32, steps=2, warmup=2, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("system", ["pytorch", "chunkstar"])
def test_run_end_to_end(system: str) -> None:
    spec = _tiny(system)
    r = run(spec, timeout_s=300, echo=False)
    assert r.status == "ok", r.message
    assert r.n_params == n_params(get("cpu-tiny"))
    assert r.step_time_s and r.step_time_s > 0
    assert r.tokens_per_s == pytest.approx(2 * 32 / r.step_time_s)
    assert r.tflops_per_gpu_patrickstar == pytest.approx(8 * r.n_params * 2 * 32 / r.step_time_s / 1e12)
    assert r.tflops_per_gpu_megatron and r.tflops_per_gpu_megatron > 0
    assert "8*N*B*s" in r.flops_formulas["tflops_per_gpu_patrickstar"]
    assert r.mfu is None  # no known peak for a CPU
    assert r.peak_host_bytes and 100 * 2**20 < r.peak_host_bytes < 8 * 2**30
    assert len(r.details["step_times_s"]) == 2 and len(r.details["losses"]) == 4
    assert r.versions["torch"] != "not installed" and r.created_utc
    json.dumps(r.config(), default=str)  # storable
    if system == "chunkstar":
        assert r.peak_device_kind and "virtual device" in r.peak_device_kind
        assert r.peak_device_bytes and r.peak_device_bytes > 0
        assert r.details["device_budget_bytes"] == chunkstar_budget_bytes(get("cpu-tiny"), 2, 32, None)
    else:
        assert r.peak_device_bytes is None


def test_host_cap_kills_the_run_as_oom() -> None:
    r = run(_tiny("pytorch", host_mem_cap_bytes=150 * 2**20), timeout_s=300, echo=False)
    assert r.status == "oom"
    assert "cap" in r.message


def test_a_bad_config_is_an_error_with_its_message() -> None:
    r = run(_tiny("chunkstar", chunkstar_budget="lots of memory"), timeout_s=300, echo=False)
    assert r.status == "error"
    assert "lots of memory" in r.message


def test_spec_is_checked_at_the_edge() -> None:
    with pytest.raises(ValueError, match="system"):
        RunSpec(system="megatron", model="cpu-tiny", batch=1, steps=1, warmup=0)
    with pytest.raises(KeyError, match="unknown model"):
        RunSpec(system="pytorch", model="nope", batch=1, steps=1, warmup=0)
    with pytest.raises(ValueError, match="seq_len"):
        RunSpec(system="pytorch", model="cpu-tiny", batch=1, steps=1, warmup=0, seq_len=4096)
    with pytest.raises(ValueError, match="chunkstar_overlap is only used by chunkstar"):
        _tiny("pytorch", chunkstar_overlap=False)
    with pytest.raises(ValueError, match="CPU virtual device"):
        _tiny("chunkstar", chunkstar_link="1GB/s", device="cuda")
    spec = _tiny("fsdp2", host_mem_cap_bytes=123)
    assert RunSpec.from_json(spec.to_json()) == spec
    linked = _tiny("chunkstar", chunkstar_link="8GB/s", chunkstar_overlap=False)
    assert RunSpec.from_json(linked.to_json()) == linked


def test_oom_classification() -> None:
    assert _is_oom(MemoryError())
    assert _is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"))
    assert _is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not _is_oom(ValueError("shape mismatch"))


def test_chunkstar_budget_forms() -> None:
    tiny, base = get("cpu-tiny"), get("cpu-base")
    assert chunkstar_budget_bytes(tiny, 1, 32, 12345) == 12345
    assert chunkstar_budget_bytes(tiny, 1, 32, "1MiB") == 2**20
    auto = chunkstar_budget_bytes(base, 4, 128, None)
    assert auto == chunkstar_budget_bytes(base, 4, 128, "auto") == chunkstar_budget_bytes(base, 4, 128, "params:0.6")
    assert chunkstar_budget_bytes(base, 4, 128, "params:0.9") > auto
    # the disk system's emulated GPU stays small against the model: its bytes are host memory under the cap
    big = get("cpu-4b")
    plain, disk = (chunkstar_budget_bytes(big, 2, 128, None, disk=d) for d in (False, True))
    assert plain - disk == int(0.6 * 2 * n_params(big)) - DISK_PARAM_ROOM > 0
    assert chunkstar_budget_bytes(base, 4, 128, None, disk=True) == auto  # 60% of a small model is less
    assert chunkstar_budget_bytes(big, 2, 128, "params:0.6", disk=True) == plain  # what the user names is kept
