"""The comparison tables (step-time, overlap): rows, pooling over rounds, targets, and one real table end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from chunkstar_bench.cli import main
from chunkstar_bench.comparisons import overlap, step_time
from chunkstar_bench.comparisons.rounds import Pooled, Row, Target, judge, notes, text_table
from chunkstar_bench.harness import Context
from chunkstar_bench.results import ResultsDB
from chunkstar_bench.runner import RunRecord
from chunkstar_bench.systems.chunkstar import engine_config
from chunkstar_bench.zoo import get, n_params
from tests.bench._records import record


def _timed(system: str, times: list[float], peak: int = 2**30, status: str = "ok", load: float | None = 0.0) -> RunRecord:
    r = record(system, status=status, peak_host=peak)
    r.details.update(step_times_s=times, other_load_cores=load)
    return r


def _pooled(name: str, *records: RunRecord) -> Pooled:
    return Pooled(Row(name, name, records[0].spec), list(records))


def test_rounds_pool_their_timed_steps_and_keep_the_worst_peak() -> None:
    p = _pooled("a", _timed("pytorch", [1.0, 3.0], peak=100, load=0.1), _timed("pytorch", [2.0, 10.0], peak=300, load=None))
    assert p.ok and p.step_times == [1.0, 3.0, 2.0, 10.0] and p.median_s == 2.5
    assert p.peak_host_bytes == 300 and p.other_load == 0.1 and p.losses == [1.0, 0.9]
    bad = _pooled("b", _timed("pytorch", [1.0]), _timed("pytorch", [], status="oom"))
    assert not bad.ok and bad.failure is bad.records[1]


def test_targets_pass_miss_and_skip() -> None:
    pooled = {
        "fast": _pooled("fast", _timed("pytorch", [1.0], peak=200)),
        "slow": _pooled("slow", _timed("chunkstar", [2.0], peak=100)),
        "broken": _pooled("broken", _timed("deepspeed", [], status="error")),
    }
    verdicts = judge(
        [
            Target("slow", "fast", "step", "<=", 1.5),  # 2.0x: MISS
            Target("slow", "fast", "step", ">=", 1.5),  # PASS
            Target("slow", "fast", "rss", "<", 1.0),  # 0.5x: PASS
            Target("broken", "fast", "step", "<=", 9.0),  # a side failed
            Target("slow", "fast", "step", None),  # context only
            Target("slow", "absent", "step", "<=", 1.0),  # a row not run: left out
        ],
        pooled,
    )
    assert [(v.verdict, v.value) for v in verdicts] == [("MISS", 2.0), ("PASS", 2.0), ("PASS", 0.5), ("n/a", None), ("-", 2.0)]
    assert verdicts[2].target.name == "peak RSS slow / fast" and verdicts[0].target.bound == "<= 1.50x"


def test_text_table_aligns_columns() -> None:
    assert text_table(["a", "bb"], [["xyz", "1"], ["q", "22"]]).splitlines() == ["a    bb", "---  --", "xyz   1", "q    22"]


def test_notes_give_a_failure_or_the_rows_own_details_then_its_notes() -> None:
    ran = _timed("deepspeed", [1.0])
    ran.details["notes"] = ["used torch AdamW", "second"]
    pooled = {
        "ran": _pooled("ran", ran, _timed("deepspeed", [2.0])),
        "failed": _pooled("failed", _timed("chunkstar", [1.0]), _timed("chunkstar", [], status="oom")),
    }
    lines = notes(pooled, lambda name, p: [f"{name}: {len(p.records)} rounds"])
    assert lines == ["ran: 2 rounds", "ran: NOTE used torch AdamW", "ran: NOTE second", "failed: oom: MemoryError: test"]


def test_step_time_pressure_budget_is_sized_on_the_measured_non_model_peak() -> None:
    settings = step_time.StepTimeSettings(model="cpu-tiny", seq=32, steps=1, warmup=1)
    rows = {r.name: r for r in step_time.rows(settings, step_time.ROW_NAMES)}
    assert list(rows) == list(step_time.ROW_NAMES)
    assert {r.spec.system for r in rows.values()} == {"pytorch", "chunkstar", "deepspeed", "fsdp2"}
    assert rows["chunkstar"].spec.chunkstar_budget == 16 * 2**30
    pressure = rows["chunkstar-pressure"]
    assert pressure.spec.chunkstar_budget == "params:0.6"  # no measurement yet: the estimate
    assert pressure.refine is not None
    measured = _timed("chunkstar", [1.0])
    measured.details["chunkstar_stats"] = {"warmup_non_model_peak_bytes": 40_000_000}
    room = int(0.6 * 2 * n_params(get("cpu-tiny")))
    assert pressure.refine(pressure.spec, {"chunkstar": measured}).chunkstar_budget == 40_000_000 + room
    failed = _timed("chunkstar", [], status="oom")
    assert pressure.refine(pressure.spec, {"chunkstar": failed}) == pressure.spec
    fixed = step_time.rows(dataclasses.replace(settings, pressure_budget_bytes=123_456_789), ["chunkstar-pressure"])[0]
    assert fixed.spec.chunkstar_budget == 123_456_789 and fixed.refine is not None
    assert fixed.refine(fixed.spec, {"chunkstar": measured}).chunkstar_budget == 123_456_789
    with pytest.raises(ValueError, match="unknown rows"):
        step_time.rows(settings, ["megatron"])


def test_overlap_rows_reach_the_engine_config() -> None:
    rows = {r.name: r for r in overlap.rows(overlap.OverlapSettings())}
    assert list(rows) == list(overlap.ROW_NAMES)
    linked = rows["chunkstar-1gb-serial"].spec
    assert (linked.chunkstar_link, linked.chunkstar_overlap, linked.threads) == ("1GB/s", False, 1)
    assert linked.chunkstar_budget == int(0.5 * 2 * n_params(get(overlap.MODEL))) + overlap.NON_MODEL_BYTES
    assert rows["deepspeed"].spec.chunkstar_link is None and rows["chunkstar-free"].spec.chunkstar_budget == 16 * 2**30
    # the keys the spec sets are the engine's own: chunkstar's config parser accepts them
    from chunkstar.config import parse_config

    assert isinstance(linked.chunkstar_budget, int)
    config = engine_config(Context(linked), linked.chunkstar_budget)
    assert config["overlap"] is False and config["device_link_bandwidth"] == "1GB/s"
    parsed = parse_config(config)
    assert parsed.placement.overlap is False and parsed.placement.link_bandwidth == 1e9


def test_step_time_table_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real runs: chunkstar, then chunkstar-pressure under the budget sized on its measurement."""
    db, out = tmp_path / "st.sqlite", tmp_path / "st.json"
    argv = [
        "step-time", "--model", "cpu-tiny", "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "2",
        "--systems", "chunkstar-pressure,chunkstar", "--pressure-fraction", "1.0", "--db", str(db), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "model: cpu-tiny" in text and "peak RSS chunkstar / deepspeed" not in text  # only the rows run
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.startswith("chunkstar")}
    assert lines["chunkstar"][1] == "ok" and lines["chunkstar-pressure"][1] == "ok", text
    runs = ResultsDB(db, read_only=True).runs()
    assert list(runs["suite"]) == ["step-time", "step-time"] and list(runs["system"]) == ["chunkstar", "chunkstar"]
    free, pressured = (json.loads(c)["details"] for c in runs["config_json"])
    assert (free["row"], pressured["row"]) == ("chunkstar", "chunkstar-pressure")
    non_model = free["chunkstar_stats"]["warmup_non_model_peak_bytes"]
    assert pressured["device_budget_bytes"] == non_model + int(1.0 * 2 * n_params(get("cpu-tiny")))
    document = json.loads(out.read_text())
    assert document["benchmark"] == "step-time" and document["settings"]["model"] == "cpu-tiny"
    assert [r["status"] for r in document["rows"]["chunkstar-pressure"]["records"]] == ["ok"]
    assert {c["name"] for c in document["comparisons"]} == set()  # no target pairs two of these rows


def test_step_time_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--systems", "pytorch,megatron"], "unknown ['megatron']"),
        (["--model", "GPT-5"], "unknown model 'GPT-5'"),
        (["--model", "cpu-tiny", "--seq", "4096"], "seq_len 4096 exceeds"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            main(["step-time", *argv])
        assert message in capsys.readouterr().err, argv


def test_step_time_overhead_rows_run_their_own_workload_without_clipping() -> None:
    """The overhead case (issue 17, section 4): its own model and batch, no clipping, everything
    resident, both rows run by default, one target between them."""
    settings = step_time.StepTimeSettings(model="cpu-tiny", seq=32, steps=1, warmup=1)
    rows = {r.name: r for r in step_time.rows(settings, step_time.DEFAULT_ROWS)}
    assert set(step_time.OVERHEAD_ROWS) <= set(rows)
    plain, ours = rows["pytorch-overhead"].spec, rows["chunkstar-overhead"].spec
    for spec in (plain, ours):
        assert (spec.model, spec.batch, spec.seq, spec.clip) == ("gpt2-49m-v8k", 4, 128, 0.0)
    assert (plain.system, ours.system, ours.chunkstar_budget) == ("pytorch", "chunkstar", 16 * 2**30)
    assert rows["chunkstar"].spec.clip == 1.0 and rows["chunkstar"].spec.model == "cpu-tiny"  # the main table as before
    model = get("gpt2-49m-v8k")
    assert (model.hidden, model.layers, model.vocab, n_params(model)) == (768, 6, 8192, 48_918_528)
    assert [t for t in step_time.TARGETS if t.numerator == "chunkstar-overhead"] == [
        Target("chunkstar-overhead", "pytorch-overhead", "step", "<=", 1.05)
    ]
    # the engine gets no clipping (and its config parser takes it)
    from chunkstar.config import parse_config

    config = engine_config(Context(ours), 16 * 2**30)
    assert config["gradient_clipping"] == 0.0 and parse_config(config).optimizer.gradient_clipping == 0.0
    with pytest.raises(ValueError, match="clip must be >= 0"):
        dataclasses.replace(plain, clip=-1.0)


def test_step_time_overhead_ratio_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """Two real runs of the overhead pair, side by side in one command: the ratio is printed with its target."""
    argv = [
        "step-time", "--systems", "pytorch-overhead,chunkstar-overhead", "--overhead-model", "cpu-tiny",
        "--overhead-batch", "1", "--overhead-seq", "16", "--steps", "1", "--warmup", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "overhead case (pytorch-overhead, chunkstar-overhead): cpu-tiny" in text and "no gradient clipping" in text
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.split() and ln.split()[0].endswith("-overhead")}
    assert lines["pytorch-overhead"][1] == "ok" and lines["chunkstar-overhead"][1] == "ok", text
    tokens = float(lines["chunkstar-overhead"][5])  # tokens/s of the row's own batch: 1 x 16 tokens per step
    assert tokens == pytest.approx(16 / float(lines["chunkstar-overhead"][2]), rel=0.05), text  # (s/step printed rounded)
    verdict = [ln for ln in text.splitlines() if ln.startswith("step time chunkstar-overhead / pytorch-overhead")]
    assert len(verdict) == 1 and "<= 1.05x" in verdict[0] and verdict[0].split()[-1] in ("PASS", "MISS"), text
