"""Hand-made RunRecords for tests that need rows without running anything."""

from __future__ import annotations

from chunkstar_bench.runner import RunRecord, RunSpec


def record(
    system: str = "chunkstar", model: str = "cpu-tiny", *, status: str = "ok", nprocs: int = 1,
    hardware: str = "cpu", step: float = 0.5, cap: int | None = None, peak_host: int = 2**30,
) -> RunRecord:
    spec = RunSpec(
        system=system, model=model, batch=2, steps=2, warmup=1, nprocs=nprocs,
        device="cpu" if hardware == "cpu" else "cuda", hardware=hardware, host_mem_cap_bytes=cap,
    )
    from chunkstar_bench.zoo import get, n_params

    ok = status == "ok"
    return RunRecord(
        spec=spec, status=status, message="" if ok else "MemoryError: test",  # type: ignore[arg-type]
        step_time_s=step if ok else None, tokens_per_s=2 * spec.seq / step if ok else None,
        tflops_per_gpu_patrickstar=(8 * n_params(get(model)) * 2 * spec.seq / step / 1e12) if ok else None,
        tflops_per_gpu_megatron=1.0 if ok else None, flops_formulas={"tflops_per_gpu_patrickstar": "patrickstar: 8*N*B*s"},
        peak_host_bytes=peak_host, n_params=n_params(get(model)), created_utc="2025-01-01T00:00:00+00:00",
        versions={"torch": "x"}, git_commit="abc", host="testhost", details={"losses": [1.0, 0.9]},
    )
