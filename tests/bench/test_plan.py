"""The capacity planner: shapes, bytes-per-parameter arithmetic, monotonicity, and the paper's nodes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from chunkstar_bench import plan, zoo
from chunkstar_bench.plan import GIB, HARDWARE, SYSTEMS, Hardware, Workload


def test_param_shapes_match_hugging_face_gpt2() -> None:
    spec = zoo.ModelSpec(name="t", hidden=64, layers=3, heads=4, seq_len=32, vocab=101)
    model = zoo.build_hf(spec)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert plan.gpt2_param_shapes(spec) == real
    assert sum(math.prod(s) for _, s in real) == zoo.n_params(spec)


@pytest.mark.parametrize("name", ["GPT2_1B", "GPT3_18B", "GPT_DS_68B", "cpu-base"])
def test_layout_holds_every_parameter_once(name: str) -> None:
    spec = zoo.get(name)
    for world in (1, 8):
        layout = plan.chunk_layout(spec, world)
        assert layout.used_elements == zoo.n_params(spec)
        assert layout.n_chunks % world == 0
        assert layout.total_elements >= layout.used_elements


def test_bytes_per_param() -> None:
    assert plan.model_data_bytes_per_param("chunkstar") == 14.0
    assert plan.model_data_bytes_per_param("deepspeed") == 18.0
    assert plan.model_data_bytes_per_param("fsdp2") == 16.0
    assert plan.model_data_bytes_per_param("pytorch", 8) == 16.0 * 8
    assert plan.model_data_bytes_per_param("pytorch-ddp", 8) == 16.0 * 8  # the planner's old name, read as an alias
    assert plan.model_data_bytes_per_param("pytorch-fsdp", 8) == 16.0


def _exact_fit(system: str, spec: zoo.ModelSpec, gpus: int, workload: Workload = Workload()) -> Hardware:
    """A node whose GPUs hold exactly the system's device need (no spare) and a huge host."""
    probe = Hardware("probe", gpus, 1024 * GIB, 1 << 50)
    need = plan.footprint(system, spec, probe, workload).device_need
    gpu_mem = (need + plan.DEVICE_RESERVED_BYTES) / (1 - plan.DEVICE_FRAGMENTATION)
    return Hardware("exact", gpus, math.ceil(gpu_mem), 1 << 50)


@pytest.mark.parametrize("gpus", [1, 4])
def test_chunkstar_host_holds_14_bytes_per_chunk_element_when_the_gpus_have_no_spare(gpus: int) -> None:
    spec = zoo.get("GPT2_1B")
    layout = plan.chunk_layout(spec, gpus)
    hw = _exact_fit("chunkstar", spec, gpus)
    fp = plan.footprint("chunkstar", spec, hw)
    assert fp.device_fits and fp.host_fits
    spare = (hw.device_usable - fp.device_need) * gpus
    assert 0 <= spare < 2 * gpus  # rounding of the capacity only
    assert fp.host_need == 14 * layout.total_elements - spare
    # activations + two gathered groups of `gpus` bf16 param chunks
    assert fp.device_need == fp.activations + 2 * gpus * 2 * max(layout.chunk_sizes)
    # every byte of spare device memory takes a byte of model data off the host
    roomy = replace(hw, gpu_mem_bytes=hw.gpu_mem_bytes + GIB)
    assert plan.footprint("chunkstar", spec, roomy).host_need == pytest.approx(fp.host_need - gpus * GIB * 0.95, rel=1e-6)


def test_other_systems_bytes() -> None:
    spec = zoo.get("GPT3_6B")
    p = zoo.n_params(spec)
    hw = HARDWARE["v100x8_240gb"]
    act = plan.activation_bytes(spec, Workload().batch)
    ds = plan.footprint("deepspeed", spec, hw)
    assert ds.host_need == 18 * p  # nothing of it on the GPUs
    assert ds.device_need > act
    ddp = plan.footprint("pytorch", spec, hw)
    assert ddp.device_need == act + 16 * p and ddp.host_need == 0
    fsdp = plan.footprint("pytorch-fsdp", spec, hw)
    assert act + 16 * p / 8 < fsdp.device_need < ddp.device_need and fsdp.host_need == 0


def test_activation_model() -> None:
    spec = zoo.get("GPT3_18B")
    h, s, a, L, V = spec.hidden, spec.seq_len, spec.heads, spec.layers, spec.vocab
    per_layer = s * (34 * h + 5 * a * s)  # Korthikanti et al., bf16, batch 1
    logits = s * V * 6
    assert plan.activation_bytes(spec, 1, checkpointing=False) == L * per_layer + logits
    assert plan.activation_bytes(spec, 1, checkpointing=True) == 2 * s * h * L + per_layer + logits
    assert plan.activation_bytes(spec, 4) == 4 * plan.activation_bytes(spec, 1)
    assert plan.activation_bytes(spec, 1, checkpointing=True) < plan.activation_bytes(spec, 1, checkpointing=False)


def _max_params(system: str, hw: Hardware, workload: Workload = Workload()) -> int:
    best = plan.predict_max(system, hw, workload).best
    return best.n_params if best else 0


@pytest.mark.parametrize("system", SYSTEMS)
def test_more_memory_never_predicts_a_smaller_model(system: str) -> None:
    base = HARDWARE["v100x8_240gb"]
    for field, steps in (("gpu_mem_bytes", (8, 16, 32, 48, 80, 141)), ("host_mem_bytes", (64, 128, 240, 512, 1024, 2048))):
        sizes = [_max_params(system, replace(base, **{field: gib * GIB})) for gib in steps]
        assert sizes == sorted(sizes), (system, field, sizes)
    # a smaller micro-batch (fewer activations) never predicts a smaller model either
    by_batch = [_max_params(system, base, Workload(batch=b)) for b in (16, 8, 4, 1)]
    assert by_batch == sorted(by_batch), (system, by_batch)


def test_chunkstar_fits_more_than_deepspeed_on_the_papers_nodes() -> None:
    for hw in (HARDWARE["v100x8_240gb"], HARDWARE["a100x8_1tb"]):
        assert _max_params("chunkstar", hw) >= _max_params("deepspeed", hw)
        assert _max_params("pytorch-fsdp", hw) >= _max_params("pytorch", hw)


def test_planned_systems_are_the_canonical_names() -> None:
    assert set(SYSTEMS) == {"chunkstar", "chunkstar-disk", "deepspeed", "fsdp2", "pytorch", "pytorch-fsdp"}
    with pytest.raises(ValueError, match="unknown system 'deepspeed-nvme'"):
        plan.footprint("deepspeed-nvme", zoo.get("GPT2_1B"), HARDWARE["v100x8_240gb"])


def test_predictions_beside_published_on_the_papers_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    for name, published in (("v100x8_240gb", 18e9), ("a100x8_1tb", 68e9)):
        assert plan.main(["plan", "--hardware", name]) == 0
        out = capsys.readouterr().out
        assert out.startswith("PREDICTION")
        assert f"{published / 1e9:.0f}B (patrickstar, published)" in out
        row = next(r for r in plan.plan(HARDWARE[name], [Workload()]) if r.system == "chunkstar")
        assert row.published is not None and row.published.nominal_params == published
        assert row.published.system == "patrickstar"  # the published system standing beside chunkstar
        assert row.prediction.best is not None
        predicted = row.prediction.best.n_params
        # same order of magnitude as the paper's maximum on the same node
        assert published / 10 < predicted < published * 10, (name, predicted)
        assert row.prediction.best.model in out


def test_cli_custom_node_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["plan", "--hardware", "custom", "--gpus", "1", "--gpu-mem", "2", "--host-mem", "8", "--models", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "custom" in out and "cpu-" in out
    with pytest.raises(SystemExit, match="--gpu-mem"):
        plan.main(["plan", "--hardware", "custom", "--gpus", "1", "--host-mem", "8"])
    with pytest.raises(SystemExit, match="unknown system"):
        plan.main(["plan", "--systems", "chunkstar,megatron"])
    with pytest.raises(SystemExit, match="unknown model"):
        plan.main(["plan", "--models", "GPT_9000B"])


def test_tiny_node_fits_nothing() -> None:
    hw = Hardware("tiny", 1, 2 * GIB, 16 * GIB)
    pred = plan.predict_max("pytorch", hw)
    assert pred.best is None and pred.binding == "device"
    rows = plan.plan(hw, [Workload()], ["pytorch-ddp"])  # an old name: planned under the canonical one
    assert [r.system for r in rows] == ["pytorch"]
    assert "(none fits)" in plan.format_plan(hw, rows, Workload())


def test_fsdp2_offload_keeps_16_bytes_on_the_host() -> None:
    spec = zoo.get("GPT3_6B")
    fp = plan.footprint("fsdp2", spec, HARDWARE["a100x8_1tb"])
    assert fp.host_need == 16 * zoo.n_params(spec)
    assert fp.device_need > plan.activation_bytes(spec, Workload().batch)


def _append(db: object, system: str, model: str, status: str, hardware: str = "v100x8_240gb", nprocs: int = 8) -> None:
    from chunkstar_bench.runner import RunRecord, RunSpec

    spec = RunSpec(system=system, model=model, batch=4, steps=2, warmup=1, nprocs=nprocs, hardware=hardware)
    ok = status == "ok"
    record = RunRecord(
        spec=spec, status=status, message="" if ok else "CUDA out of memory", n_params=zoo.n_params(zoo.get(model)),  # type: ignore[arg-type]
        step_time_s=1.0 if ok else None, tokens_per_s=1000.0 if ok else None, created_utc="2025-01-01T00:00:00Z",
    )  # fmt: skip
    db.append(record, suite="maxscale")  # type: ignore[attr-defined]


def test_measured_maxima_from_a_results_db(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from chunkstar_bench.results import ResultsDB

    db = ResultsDB(tmp_path / "runs.sqlite")
    _append(db, "chunkstar", "GPT2_1B", "ok")
    _append(db, "chunkstar", "GPT2_4B", "ok")
    _append(db, "chunkstar", "GPT3_6B", "oom")
    _append(db, "deepspeed", "GPT2_2B", "ok")
    _append(db, "pytorch", "GPT2_1B", "ok")
    _append(db, "chunkstar", "GPT3_8B", "ok", hardware="a100x8_1tb")  # another node
    _append(db, "chunkstar", "GPT3_10B", "ok", nprocs=4)  # another GPU count
    got = plan.measured_max(str(db.path), "v100x8_240gb", 8)
    assert {k: v.model for k, v in got.items()} == {"chunkstar": "GPT2_4B", "deepspeed": "GPT2_2B", "pytorch": "GPT2_1B"}
    assert plan.measured_max(str(db.path), "v100x8_240gb", 4)["chunkstar"].model == "GPT3_10B"
    assert plan.main(["plan", "--hardware", "v100x8_240gb", "--checkpointing", "on", "--db", str(db.path)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("chunkstar "))
    assert "GPT2_4B (4.20B)" in line and "18B (patrickstar, published)" in line
    line = next(ln for ln in out.splitlines() if ln.startswith("pytorch "))
    assert "GPT2_1B (1.11B)" in line and "1B (pytorch, published)" in line  # measured beside published, one name
    with pytest.raises(SystemExit, match="no such file"):  # a plan opens the DB read-only: never creates it
        plan.main(["plan", "--db", str(tmp_path / "missing.sqlite")])
    assert not (tmp_path / "missing.sqlite").exists()


# ---------------------------------------------------------------------------------------------- the disk tier

TB = 10**12


def test_chunkstar_disk_keeps_12_bytes_per_chunk_element_on_disk() -> None:
    spec = zoo.get("GPT2_1B")
    for gpus in (1, 4):
        layout = plan.chunk_layout(spec, gpus)
        chunk = max(layout.chunk_sizes)
        hw = replace(_exact_fit("chunkstar", spec, gpus), disk_bytes=TB)
        fp = plan.footprint("chunkstar-disk", spec, hw)
        plain = plan.footprint("chunkstar", spec, hw)
        assert fp.fits and fp.binding is None
        assert fp.device_need == plain.device_need  # the same activations and working set
        assert fp.disk_need == 12 * layout.total_elements and fp.disk_usable == TB
        # the engine's auto staging budget: two chunks of each of the three fp32 state lists, per process
        # (the least it takes: one fp32 state chunk, which a between-step access stages whole; the
        # step updates a chunk in slices)
        assert fp.staging == 2 * 3 * 4 * chunk and fp.staging_min == 4 * chunk
        spare = (hw.device_usable - fp.device_need) * gpus
        assert 0 <= spare < 2 * gpus
        assert fp.host_need == 2 * layout.total_elements - spare + gpus * fp.staging
        assert plain.host_need == fp.host_need + fp.disk_need - gpus * fp.staging  # 12 of chunkstar's 14 went to disk
        # spare device memory holds param chunks, never the state (no device Adam with the disk tier)
        huge = replace(hw, gpu_mem_bytes=hw.gpu_mem_bytes + 64 * GIB)
        roomy = plan.footprint("chunkstar-disk", spec, huge)
        assert roomy.host_need == gpus * fp.staging and roomy.disk_need == fp.disk_need
        assert plan.footprint("chunkstar", spec, huge).host_need == 0


def test_chunkstar_disk_is_bound_by_its_disk_and_its_staging() -> None:
    spec = zoo.get("GPT2_1B")
    hw = replace(HARDWARE["v100x8_240gb"], disk_bytes=TB)
    need = plan.footprint("chunkstar-disk", spec, hw).disk_need
    assert plan.footprint("chunkstar-disk", spec, replace(hw, disk_bytes=need)).fits
    short = plan.footprint("chunkstar-disk", spec, replace(hw, disk_bytes=need - 1))
    assert not short.fits and short.binding == "disk" and short.device_fits and short.host_fits
    no_disk = plan.predict_max("chunkstar-disk", HARDWARE["v100x8_240gb"])
    assert no_disk.best is None and no_disk.binding == "disk"
    # a staging budget below the least the engine takes (one state chunk) is refused; more costs host memory
    fp = plan.footprint("chunkstar-disk", spec, hw)
    low = plan.footprint("chunkstar-disk", spec, hw, Workload(staging_budget=fp.staging_min - 1))
    assert not low.fits and low.binding == "staging"
    least = plan.footprint("chunkstar-disk", spec, hw, Workload(staging_budget=fp.staging_min))
    assert least.fits and least.host_need == fp.host_need - hw.gpus * (fp.staging - fp.staging_min)


def test_the_disk_tier_lifts_a_host_bound_node() -> None:
    hw = replace(HARDWARE["v100x8_240gb"], disk_bytes=2 * TB)
    with_disk = plan.predict_max("chunkstar-disk", hw)
    without = plan.predict_max("chunkstar", hw)
    assert without.binding == "host"
    assert with_disk.best is not None and without.best is not None
    assert with_disk.best.n_params > without.best.n_params
    # the same model needs less host memory with its optimizer state on disk (the largest models of
    # the two differ, and the larger one's param chunks alone can outweigh the smaller one's state)
    same = plan.footprint("chunkstar-disk", plan.models_named(without.best.model)[0], hw)
    assert same.host_need < without.best.host_need


def test_more_disk_never_predicts_a_smaller_model() -> None:
    base = HARDWARE["a100x8_1tb"]
    sizes = [_max_params("chunkstar-disk", replace(base, disk_bytes=tb * TB)) for tb in (0, 0.25, 0.5, 1, 2, 4, 8, 16)]
    assert sizes == sorted(sizes) and sizes[0] == 0 < sizes[-1]
    by_host = [_max_params("chunkstar-disk", replace(base, disk_bytes=4 * TB, host_mem_bytes=g * GIB)) for g in (64, 128, 256, 1024)]
    assert by_host == sorted(by_host)


def test_cli_disk_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["plan", "--hardware", "v100x8_240gb", "--checkpointing", "on"]) == 0
    plain = capsys.readouterr().out
    assert "chunkstar-disk" not in plain and "disk GiB" not in plain
    assert plan.main(["plan", "--hardware", "v100x8_240gb", "--checkpointing", "on", "--disk", "2TB"]) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("system "))
    assert "disk GiB" in header
    assert "disk 1,862.6 GiB free for chunk files" in out  # 2 TB, decimal
    row = next(ln for ln in out.splitlines() if ln.startswith("chunkstar-disk "))
    best = plan.predict_max("chunkstar-disk", replace(HARDWARE["v100x8_240gb"], disk_bytes=2 * TB)).best
    assert best is not None and best.model in row and f"{best.disk_need / GIB:,.1f}/1,862.6" in row
    # the other rows are what they were without the disk, plus a "-" disk column
    chunkstar_row = next(ln for ln in out.splitlines() if ln.startswith("chunkstar "))
    assert chunkstar_row.split()[:5] == next(ln for ln in plain.splitlines() if ln.startswith("chunkstar ")).split()[:5]
    assert plan.main(["plan", "--hardware", "custom", "--gpus", "1", "--gpu-mem", "2", "--host-mem", "8", "--disk", "64GiB",
                      "--models", "cpu", "--systems", "chunkstar-disk", "--staging", "256MiB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "staging per process: 256 MiB" in out and next(ln for ln in out.splitlines() if ln.startswith("chunkstar-disk "))
    with pytest.raises(SystemExit, match="--disk SIZE"):
        plan.main(["plan", "--systems", "chunkstar,chunkstar-disk"])
    with pytest.raises(SystemExit):
        plan.main(["plan", "--disk", "lots"])


def test_measured_chunkstar_disk_from_a_results_db(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from chunkstar_bench.results import ResultsDB

    db = ResultsDB(tmp_path / "runs.sqlite")
    _append(db, "chunkstar-disk", "GPT3_6B", "ok")
    _append(db, "chunkstar", "GPT2_1B", "ok")
    assert plan.measured_max(str(db.path), "v100x8_240gb", 8)["chunkstar-disk"].model == "GPT3_6B"
    assert plan.main(["plan", "--checkpointing", "on", "--disk", "2TB", "--db", str(db.path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("chunkstar-disk "))
    assert "GPT3_6B (" in line


def test_the_bench_keeps_no_copy_of_the_core_hardware_table() -> None:
    """``chunkstar.dryrun.HARDWARE`` is the one table of hardware facts: every formula preset is one of its
    entries (or an alias of one) with that entry's GPUs and device and host memory, the dry run resolves the
    same names to the same entries, and MFU divides by each entry's own peak. A figure the bench states
    again (a preset of its own, a peak typed in) fails here as soon as it differs from the core's."""
    from chunkstar.dryrun import HARDWARE as CORE

    from chunkstar_bench import flops
    from chunkstar_bench.plan.nodes import ALIASES, node_named

    assert list(HARDWARE) == [*CORE, *ALIASES]
    for name, hw in HARDWARE.items():
        alias = ALIASES.get(name)
        entry = CORE[alias.node if alias is not None else name]
        host = alias.host_memory if alias is not None and alias.host_memory is not None else entry.host_memory
        assert (hw.gpus, hw.gpu_mem_bytes, hw.host_mem_bytes) == (entry.gpus_per_node, int(entry.device_memory), int(host)), name
        assert hw.disk_bytes == 0  # the core has a disk's speed, not its free space: --disk says
        node = node_named(name)  # what --dry-run runs on under the same name
        assert (node.gpus_per_node, node.device_memory, node.host_memory, node.peak_flops) == (
            hw.gpus, hw.gpu_mem_bytes, hw.host_mem_bytes, entry.peak_flops), name  # fmt: skip
        assert flops.peak_tflops(name) == entry.peak_flops / 1e12, name
    # the peaks: one per GPU of the core table (its entries' names start with the GPU), plus only what it lacks
    assert {k: v for k, v in flops.PEAK_TFLOPS.items() if v is not None} == {
        flops._gpu_of(name): entry.peak_flops / 1e12 for name, entry in CORE.items()
    }
    assert set(flops.PEAK_TFLOPS) - {flops._gpu_of(name) for name in CORE} == {"cpu"}
