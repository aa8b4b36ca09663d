"""``chunkstar-bench plan --dry-run``: DeepSpeed's estimator against hand-computed figures, the dry-run path on a
tiny GPT (seconds), the bisection, the table's text, and the stored figures' regression gate. Nothing here
depends on how long anything takes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from chunkstar_bench import zoo
from chunkstar_bench.cli import main as cli_main
from chunkstar_bench.plan import deepspeed as ds
from chunkstar_bench.plan.dryrun import DryRunPoint, DryRunSettings, dry_run_point, largest_fitting, ranks_for
from chunkstar_bench.plan.format import format_largest, format_paper_table
from chunkstar_bench.plan.gate import LARGEST_SUITE, POINT_SUITE, gate, store
from chunkstar_bench.plan.model import HOST_PER_PROCESS_BYTES, HOST_RESERVED_BYTES, Workload, predict_max
from chunkstar_bench.plan.model import Hardware as FormulaHardware
from chunkstar_bench.plan.paper import LargestRow, PaperPoint, PaperRow, paper_points
from chunkstar_bench.published import load_published
from chunkstar_bench.units import GIB

TINY = zoo.ModelSpec("tiny-gpt", hidden=64, layers=2, heads=4, seq_len=64, vocab=256)

# ---------------------------------------------------------------------------------------------- DeepSpeed's estimator


def test_deepspeed_estimator_with_params_and_optimizer_offloaded() -> None:
    # 1e9 parameters, the largest layer 1e8, 8 GPUs on 1 node: 18 B/param x 1.5 on the host, 4 B/param of
    # the largest layer on each GPU
    assert ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1) == (27 * 10**9, 4 * 10**8, 4 * 10**8)
    # without zero_init every process first holds the fp32 model: max(4 x 8, 18) = 32 B/param x 1.5
    assert ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1, zero_init=False)[0] == 48 * 10**9
    # two nodes share the host side: 18 x 1/2 x 1.5 = 13.5 B/param per node
    assert ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 2)[0] == 13_500_000_000
    # a buffer factor of 1: the bare 18 bytes
    assert ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1, additional_buffer_factor=1.0)[0] == 18 * 10**9


def test_deepspeed_estimator_without_param_offload_and_without_offload() -> None:
    # optimizer offloaded, params not: each GPU holds its 2-byte share of the params (2e9 / 8) on top
    cpu, gpu, largest = ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1, cpu_offload_params=False)
    assert (cpu, gpu, largest) == (24 * 10**9, 4 * 10**8 + 250_000_000, 4 * 10**8)
    # nothing offloaded: 18 bytes per parameter over the 8 GPUs, the host only for zero_init's largest layer
    cpu, gpu, _ = ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1, cpu_offload=False, cpu_offload_params=False)
    assert gpu == 4 * 10**8 + 2_250_000_000
    assert cpu == 10**8 * 4 * 8 * 1.5
    cpu, _, _ = ds.zero3_model_states_mem_needs(10**9, 10**8, 8, 1, cpu_offload=False, cpu_offload_params=False, zero_init=False)
    assert cpu == 48 * 10**9


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_model_to_params_counts_the_tied_embedding_once(device: str) -> None:
    big_vocab = zoo.ModelSpec("big-vocab", hidden=64, layers=2, heads=4, seq_len=64, vocab=1024)
    for spec, expected in ((big_vocab, 1024 * 64), (TINY, 4 * 64 * 64 + 4 * 64)):  # the embedding V x h; the MLP's up projection
        with torch.device(device):
            model = zoo.build_hf(spec)
        total, largest = ds.model_to_params(model)
        assert total == zoo.n_params(spec)  # the LM head is the token embedding (on meta too: by identity, not data_ptr)
        assert largest == ds.gpt2_largest_layer_params(spec) == expected


def test_deepspeed_verdicts_on_the_v100_node() -> None:
    # by hand: GPT3_8B (h 3072, 72 layers) has 50257*3072 + 1024*3072 + 72*(12*3072^2 + 13*3072) + 2*3072
    # = 8,314,143,744 parameters; x 27 = 209.07 GiB of host, under 240 GiB. GPT3_10B (h 4096, 50 layers):
    # 10,279,047,168 x 27 = 258.47 GiB, over it.
    host, device = 240 * GIB, int(31.5 * GIB)
    v8 = ds.deepspeed_verdict(zoo.get("GPT3_8B"), 8, host, device)
    assert v8.n_params == 8_314_143_744 and v8.cpu_bytes == 8_314_143_744 * 27 and v8.fits
    assert v8.gpu_bytes == 4 * 50257 * 3072  # the embedding is the largest layer
    v10 = ds.deepspeed_verdict(zoo.get("GPT3_10B"), 8, host, device)
    assert v10.cpu_bytes == 10_279_047_168 * 27 and not v10.fits and v10.binding == "host"
    best, blocked = ds.deepspeed_largest([zoo.get(n) for n in ("GPT3_10B", "GPT2_1B", "GPT3_8B")], 8, host, device)
    assert best is not None and best.model == "GPT3_8B" and blocked is not None and blocked.model == "GPT3_10B"


# ---------------------------------------------------------------------------------------------- the dry run


def test_dry_run_point_on_a_tiny_gpt() -> None:
    lines: list[str] = []
    p = dry_run_point(TINY, "v100x8_240gb", 2, 2, progress=lines.append)
    assert p.fits and not p.failed and p.why_not is None and p.ranks == (0, 1)
    assert p.n_params == zoo.n_params(TINY) and p.seq_len == 64 and p.chunk_size is None and p.chunk_elements
    assert 0 < p.minimum_budget < p.device_memory
    # the host: two ranks' chunk buffers plus the fixed overheads
    assert p.host_need > HOST_RESERVED_BYTES + 2 * HOST_PER_PROCESS_BYTES
    assert p.seconds is not None and p.seconds > 0 and p.binding in p.busy
    assert p.tflops_per_gpu == pytest.approx(8 * p.n_params * 2 * 64 / p.seconds / 1e12)
    assert any("rank 1 of 2" in line for line in lines)


def test_a_device_too_small_is_a_verdict_not_an_error() -> None:
    from chunkstar.dryrun import HARDWARE

    tiny_gpu = HARDWARE["v100x8_240gb"].__class__(**{**HARDWARE["v100x8_240gb"].__dict__, "name": "tiny-gpu", "device_memory": 200_000})
    p = dry_run_point(TINY, tiny_gpu, 2, 8, ranks="all")
    assert not p.fits and p.why_not == "device" and p.minimum_budget > 200_000
    assert p.ranks == (0,)  # a rank that does not fit ends the try
    assert p.seconds is None and p.tflops_per_gpu is None and p.error
    # PatrickStar's 256M-element chunks cannot even be made on a 200 KB device: the verdict stays auto's
    assert p.chunk_size is None and len(p.tries) == 1 and p.tries[0].startswith("256M")


def test_a_node_with_a_disk_runs_the_disk_tier() -> None:
    """LoHan/Ratel's node keeps the Adam state on its NVMe disk: so does its dry run (the real disk
    tier over files that count bytes, Note [dry run disk]); the host holds the staging pool."""
    p = dry_run_point(TINY, "rtx4090_256gb_nvme", 1, 2)
    assert p.fits and p.disk and p.busy["disk"] > 0
    plain = dry_run_point(TINY, "rtx4090_256gb_nvme", 1, 2, disk=False)
    assert not plain.disk and plain.busy["disk"] == 0
    assert not dry_run_point(TINY, "v100x8_240gb", 1, 2).disk  # the paper's nodes: no disk in their description


def test_ranks_simulated() -> None:
    assert ranks_for("first", 8) == [0] and ranks_for("ends", 8) == [0, 7] and ranks_for("ends", 1) == [0]
    assert ranks_for("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        ranks_for("some", 8)


def _point(model: str, fits: bool = True, seconds: float | None = 1.0, hardware: str = "v100x8_240gb", gpus: int = 8) -> DryRunPoint:
    spec = zoo.get(model)
    return DryRunPoint(
        hardware=hardware, gpus=gpus, model=model, n_params=zoo.n_params(spec), batch=8, seq_len=spec.seq_len,
        device_fits=fits, host_fits=True, minimum_budget=20 * GIB, device_memory=int(31.5 * GIB),
        host_need=100 * GIB if fits else 0, host_memory=240 * GIB, chunk_size=None, chunk_elements=64 * 2**20 if fits else None,
        seconds=seconds if fits else None, binding="host_adam" if fits else None,
        busy={"compute": 0.5, "host_adam": 0.8} if fits else {}, ranks=(0, 7), error="" if fits else "needs more",
    )  # fmt: skip


def test_bisection_finds_neighbours_in_few_dry_runs() -> None:
    ladder = [zoo.get(n) for n in ("GPT2_1B", "GPT2_2B", "GPT2_4B", "GPT3_6B", "GPT3_8B", "GPT3_10B", "GPT3_12B")]
    limit = zoo.n_params(zoo.get("GPT3_8B"))
    seen: list[str] = []

    def run(spec: zoo.ModelSpec) -> DryRunPoint:
        seen.append(spec.name)
        return _point(spec.name, fits=zoo.n_params(spec) <= limit)

    found = largest_fitting(list(reversed(ladder)), run, "v100x8_240gb", 8)
    assert found.best is not None and found.best.model == "GPT3_8B"
    assert found.blocked is not None and found.blocked.model == "GPT3_10B"
    assert len(seen) <= math.ceil(math.log2(len(ladder) + 1)) and len(set(seen)) == len(seen)
    everything = largest_fitting(ladder, lambda s: _point(s.name), "v100x8_240gb", 8)
    assert everything.best is not None and everything.best.model == "GPT3_12B" and everything.blocked is None
    nothing = largest_fitting(ladder, lambda s: _point(s.name, fits=False), "v100x8_240gb", 8)
    assert nothing.best is None and nothing.blocked is not None and nothing.blocked.model == "GPT2_1B"


def test_paper_points_are_the_published_rows_of_the_two_nodes() -> None:
    points = paper_points()
    published = [r for r in load_published() if r.hardware in ("v100x8_240gb", "a100x8_1tb")]
    assert sum(len(p.published) for p in points) == len(published)  # every published row of the two nodes, once
    assert {p.hardware for p in points} == {"v100x8_240gb", "a100x8_1tb"}  # not the SuperPod's
    thirty = [p for p in points if p.label == "30B"]
    assert thirty and all(p.spec is None for p in thirty)  # no config in paper_models.csv
    top = [p for p in points if p.hardware == "a100x8_1tb" and p.gpus == 8][-1]
    assert top.label == "68B" and top.published_tflops_per_gpu("patrickstar") == pytest.approx(857 / 8)
    assert [p.gpus for p in paper_points(["v100x8_240gb"], gpus=2)] == [2] * 7


def test_cli_dry_run_on_a_tiny_ladder(capsys: pytest.CaptureFixture[str]) -> None:
    status = cli_main(["plan", "--dry-run", "--hardware", "rtx4090_256gb_nvme", "--skip-table", "--models", "cpu-tiny", "--batch", "2"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "PREDICTION" in out and "rtx4090_256gb_nvme" in out and "cpu-tiny" in out and "175B (LoHan/Ratel)" in out
    assert "rank 0 of 1" in err  # progress goes to stderr
    with pytest.raises(SystemExit, match="give --dry-run-db"):
        cli_main(["plan", "--dry-run", "--gate"])
    with pytest.raises(SystemExit, match="goes with --dry-run"):
        cli_main(["plan", "--dry-run-db", "x.sqlite"])
    with pytest.raises(SystemExit, match="custom is the formula's"):
        cli_main(["plan", "--dry-run", "--hardware", "custom"])


def test_hardware_names_are_the_same_for_the_formula_and_the_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    # a node the formula did not know before it read chunkstar.dryrun.HARDWARE (the dry run's anchors), and the
    # formula's old preset name, now an alias the dry run takes too
    assert cli_main(["plan", "--hardware", "h200_1.5tb", "--checkpointing", "on", "--systems", "chunkstar"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PREDICTION") and "for h200_1.5tb: 1x H200" in out and "host 1,500.0 GiB" in out
    assert cli_main(["plan", "--hardware", "h200x1_128gb", "--checkpointing", "on", "--systems", "chunkstar"]) == 0
    assert "host 128.0 GiB" in capsys.readouterr().out
    p = dry_run_point(TINY, "h200x1_128gb", 1, 2)
    assert p.fits and p.hardware == "h200x1_128gb"


# ---------------------------------------------------------------------------------------------- the tables


def _paper_row(label: str, model: str | None, published: float, point: DryRunPoint | None) -> PaperRow:
    rows = [r for r in load_published() if r.hardware == "v100x8_240gb" and r.gpus == 8 and r.label == label]
    pub = {r.system: r for r in rows}
    assert pub["patrickstar"].tflops_per_gpu == pytest.approx(published)
    spec = zoo.get(model) if model else None
    verdict = ds.deepspeed_verdict(spec, 8, 240 * GIB, int(31.5 * GIB)) if spec else None
    return PaperRow(PaperPoint("v100x8_240gb", 8, label, spec, pub), point, verdict)


def test_paper_table_text() -> None:
    # 1B at 8 GPUs: published 444/8 = 55.5 TFLOPS per GPU. A predicted step of s seconds gives
    # 8 * N * 8 * 1024 / s / 1e12 TFLOPS.
    n = zoo.n_params(zoo.get("GPT2_1B"))
    close = 8 * n * 8 * 1024 / (55.5 * 1e12)  # exactly the published figure: ratio 1.00
    far = close * 2  # half of it: ratio 0.50, more than 30% off
    near = _paper_row("1B", "GPT2_1B", 55.5, _point("GPT2_1B", seconds=close))
    off = _paper_row("1B", "GPT2_1B", 55.5, _point("GPT2_1B", seconds=far))
    assert near.ratio == pytest.approx(1.0) and not near.disagrees
    assert off.ratio == pytest.approx(0.5) and off.disagrees
    blocked = _paper_row("18B", "GPT3_18B", 419 / 8, _point("GPT3_18B", fits=False))
    text = format_paper_table([near, off, blocked], DryRunSettings())
    lines = text.splitlines()
    near_line = next(line for line in lines if "1.00" in line)
    off_line = next(line for line in lines if "0.50" in line)
    assert "55.5" in near_line and "41.9" in near_line  # PatrickStar's 444 and DeepSpeed's 335 over 8 GPUs
    assert "host_adam 0.8, compute 0.5 of 2.6 s" in off_line and "host_adam" not in near_line  # only where > 30% off
    assert "no: device" in text and "needs more" in text  # the verdict and why
    assert "deepspeed-mp2 33.1, deepspeed-mp4 28.1, pytorch 39.4" in near_line  # every published system stands beside
    assert "fits (28/240 host" in near_line  # DeepSpeed's estimator: 1.11B x 27 bytes
    md = format_paper_table([near], DryRunSettings(), markdown=True).splitlines()
    assert md[2].startswith("| node | GPUs |") and md[3].startswith("|---|")


def test_largest_table_text() -> None:
    from chunkstar_bench.plan.dryrun import LargestSearch

    best, blocked = _point("GPT3_18B"), _point("GPT_DS_20B", fits=False)
    hw = FormulaHardware("v100x8_240gb", 8, 32 * GIB, 240 * GIB)
    models = [zoo.get("GPT3_18B"), zoo.get("GPT_DS_20B")]
    row = LargestRow(
        "v100x8_240gb", 8, LargestSearch("v100x8_240gb", 8, best, blocked, (best, blocked)),
        *ds.deepspeed_largest(models, 8, 240 * GIB, int(31.5 * GIB)),
        predict_max("chunkstar", hw, Workload(), models), {},
    )  # fmt: skip
    text = format_largest([row])
    assert "GPT3_18B (18.33B)" in text and "GPT_DS_20B (20.56B): device, needs 20.0/31.5 GiB per GPU" in text
    assert "(none fits)" in text  # DeepSpeed's estimator: 18B x 27 bytes is over 240 GiB


# ---------------------------------------------------------------------------------------------- stored, and gated


def _rows(seconds: float, fits_12b: bool) -> list[PaperRow]:
    return [
        _paper_row("1B", "GPT2_1B", 55.5, _point("GPT2_1B", seconds=seconds)),
        _paper_row("12B", "GPT3_12B", 482 / 8, _point("GPT3_12B", fits=fits_12b)),
    ]


def _largest(best: str) -> list[LargestRow]:
    from chunkstar_bench.plan.dryrun import LargestSearch

    hw = FormulaHardware("v100x8_240gb", 8, 32 * GIB, 240 * GIB)
    search = LargestSearch("v100x8_240gb", 8, _point(best), None, (_point(best),))
    return [LargestRow("v100x8_240gb", 8, search, None, None, predict_max("chunkstar", hw, Workload(), [zoo.get(best)]), {})]


def test_the_gate_compares_with_the_last_run(tmp_path: Path) -> None:
    from chunkstar_bench.results import ResultsDB

    db = tmp_path / "dryrun.sqlite"
    settings = DryRunSettings()
    assert store(db, _rows(1.0, True), _largest("GPT3_18B"), settings, commit="a", created_utc="2026-01-01T00:00:00+00:00") == 3
    regressions, summary = gate(db)
    assert regressions == [] and "nothing earlier" in summary
    # the next night: 1B 20% slower, 12B no longer fits, the largest model down to 15B
    store(db, _rows(1.25, False), _largest("GPT3_15B"), settings, commit="b", created_utc="2026-01-02T00:00:00+00:00")
    regressions, summary = gate(db)
    assert sorted(r.what for r in regressions) == ["fit", "largest", "tflops"]
    tflops = next(r for r in regressions if r.what == "tflops")
    assert tflops.now == pytest.approx(tflops.before / 1.25) and "-20.0%" in str(tflops)
    assert "2 points and 1 largest models compared, 3 regression(s)" in summary
    # a 5% slower night is within the threshold; a larger largest model is no regression
    store(db, _rows(1.3125, False), _largest("GPT3_18B"), settings, commit="c", created_utc="2026-01-03T00:00:00+00:00")
    assert gate(db)[0] == []
    runs = ResultsDB(db, read_only=True).runs()
    assert set(runs["suite"]) == {POINT_SUITE, LARGEST_SUITE}
    assert set(runs["status"]) == {"ok", "oom"} and (runs["git_commit"] == "c").sum() == 3
    assert runs["config_json"].str.contains('"kind": "dry-run prediction"').all()  # every row says it is predicted


def test_cli_gate_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "d.sqlite"
    settings = DryRunSettings(batch=2)
    store(db, [], _largest("GPT3_18B"), settings, commit="a", created_utc="2026-01-01T00:00:00+00:00")
    monkeypatch.setenv("GITHUB_SHA", "b")  # the CLI stores this commit (no git command in a test)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    # this run's largest on the rtx4090 is a tiny model; the stored one was on another node: nothing to compare
    argv = ["plan", "--dry-run", "--hardware", "rtx4090_256gb_nvme", "--skip-table", "--models", "cpu-tiny", "--batch", "2",
            "--dry-run-db", str(db), "--gate"]  # fmt: skip
    assert cli_main(argv) == 0
    assert "0 points and 0 largest models compared, 0 regression(s)" in capsys.readouterr().out


def test_the_nightly_workflow_runs_the_table_and_its_gate() -> None:
    yaml = pytest.importorskip("yaml")
    workflow = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "nightly-bench.yml"
    job = yaml.safe_load(workflow.read_text())["jobs"]["dryrun"]
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "chunkstar-bench plan --dry-run" in runs and "--dry-run-db results/dryrun.sqlite --gate" in runs
    assert "set -o pipefail" in runs  # the gate's exit status is not lost in the pipe to the summary
    cached = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/cache/")]
    assert {s["with"]["path"] for s in cached} == {"results/dryrun.sqlite"} and len(cached) == 2  # restored, and saved
    saved = next(s for s in cached if "/save@" in s["uses"])
    assert "always()" in saved["if"]  # kept after a regression too: the next night compares with tonight's
