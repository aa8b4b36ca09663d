"""The activations table (``chunkstar-bench activations``, issue 27): its rows reach the engine, the
pressured budget sits between the measured needs, the targets pair the right rows, the sequence
search stops where it should, and the whole command wired end to end over a stand-in runner.

Nothing here times anything: the runs are hand-made records (the real table is slow, docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from chunkstar_bench.cli import main
from chunkstar_bench.comparisons import activations as act
from chunkstar_bench.comparisons import rounds
from chunkstar_bench.comparisons.rounds import Pooled, Row, Unrunnable, judge
from chunkstar_bench.harness import Context
from chunkstar_bench.runner import RunRecord, RunSpec
from chunkstar_bench.systems.chunkstar import engine_config
from chunkstar_bench.units import MIB

TINY = act.ActivationsSettings(model="cpu-tiny", seq=32, search_seqs=(32, 48, 64, 96))


def _ok(spec: RunSpec, step: float, needs: int, **stats: Any) -> RunRecord:
    losses = [10.0 - 0.1 * i for i in range(spec.warmup + spec.steps)]
    details = {
        "step_times_s": [step] * spec.steps, "losses": losses, "other_load_cores": 0.0,
        "chunkstar_stats": {"minimum_budget_bytes": needs, "device_peak_bytes": needs, **stats},
    }  # fmt: skip
    return RunRecord(spec=spec, status="ok", step_time_s=step, peak_host_bytes=2**30, details=details)


def _dme(spec: RunSpec, needs: int) -> RunRecord:
    return RunRecord(
        spec=spec, status="oom", message="rank 0: DeviceMemoryError: chunkstar cannot fit ...",
        details={"device_memory_error": {"minimum_budget_bytes": needs, "budget_bytes": spec.chunkstar_budget}},
    )


def test_rows_reach_the_engine_config() -> None:
    rows = {r.name: r for r in act.rows(TINY)}
    assert list(rows) == list(act.ROW_NAMES) == [
        "keep-free", "hf-checkpointing-free", "keep", "hf-checkpointing", "offload", "auto", "auto-free",
    ]  # fmt: skip
    policy = {n: (r.spec.chunkstar_activations, r.spec.hf_checkpointing) for n, r in rows.items()}
    assert policy == {
        "keep-free": (None, False), "hf-checkpointing-free": (None, True), "keep": (None, False),
        "hf-checkpointing": (None, True), "offload": ("offload", False), "auto": ("auto", False), "auto-free": ("auto", False),
    }  # fmt: skip
    for name, row in rows.items():
        spec = row.spec
        assert (spec.system, spec.model, spec.batch, spec.seq) == ("chunkstar", "cpu-tiny", 2, 32), name
        assert (spec.chunkstar_link, spec.chunkstar_precision, spec.steps) == ("8GB/s", "fp32", 4), name
        # auto: measured, traced under the plan, a frozen step timed, and room to trace a changed plan
        assert spec.warmup == (7 if name.startswith("auto") else 3), name
        # the free rows run at the free budget; the pressured ones are sized before they run
        assert (row.refine is not None) == (name in act.PRESSURED_ROWS), name
        assert spec.chunkstar_budget == (None if name in act.PRESSURED_ROWS else TINY.free_budget_bytes), name
    from chunkstar.config import ActivationPolicy, Precision, parse_config

    for name, wanted in (("offload", ActivationPolicy.OFFLOAD), ("auto", ActivationPolicy.AUTO), ("keep", ActivationPolicy.KEEP)):
        parsed = parse_config(engine_config(Context(rows[name].spec), 100 * MIB))
        assert parsed.activations.policy is wanted and parsed.precision is Precision.FP32, name
        assert parsed.placement.link_bandwidth == 8e9, name
    bf16 = act.rows(dataclasses.replace(TINY, precision="bf16"), ["auto-free"])[0].spec
    assert parse_config(engine_config(Context(bf16), 100 * MIB)).precision is Precision.BF16
    # HF checkpointing is the model's own, on every block; the other rows' models do not checkpoint
    hf, plain = Context(rows["hf-checkpointing"].spec).build(), Context(rows["offload"].spec).build()
    assert all(b.gradient_checkpointing for b in hf.transformer.h)
    assert not any(getattr(b, "gradient_checkpointing", False) for b in plain.transformer.h)


def test_spec_fields_are_checked() -> None:
    base = act.rows(TINY)[4].spec  # offload
    assert base.chunkstar_activations == "offload" and RunSpec.from_json(base.to_json()) == base
    with pytest.raises(ValueError, match="chunkstar_activations 'sometimes' is not one of"):
        RunSpec(system="chunkstar", model="cpu-tiny", batch=1, steps=1, warmup=0, chunkstar_activations="sometimes")
    with pytest.raises(ValueError, match="chunkstar_activations is only used by chunkstar"):
        RunSpec(system="pytorch", model="cpu-tiny", batch=1, steps=1, warmup=0, chunkstar_activations="offload")
    with pytest.raises(ValueError, match="chunkstar_precision 'fp8'"):
        RunSpec(system="chunkstar", model="cpu-tiny", batch=1, steps=1, warmup=0, chunkstar_precision="fp8")


def test_pressured_budget_sits_between_the_measured_needs() -> None:
    assert act.size_budget(300, 100, 0.5) == 200 and act.size_budget(300, 100, 0.25) == 150
    with pytest.raises(ValueError, match="no budget keeps keep out"):
        act.size_budget(100, 100, 0.5)
    rows = {r.name: r for r in act.rows(TINY)}
    keep, hf = _ok(rows["keep-free"].spec, 1.0, 300 * MIB), _ok(rows["hf-checkpointing-free"].spec, 1.3, 100 * MIB)
    latest = {"keep-free": keep, "hf-checkpointing-free": hf}
    chosen = act.sizing(TINY, latest)
    assert (chosen.budget, chosen.keep_needs, chosen.hf_needs) == (200 * MIB, 300 * MIB, 100 * MIB)
    assert "keep cannot fit, full checkpointing can" in chosen.describe()
    for name in act.PRESSURED_ROWS:  # every pressured row gets that budget, nothing else changes
        refine = rows[name].refine
        assert refine is not None
        refined = refine(rows[name].spec, latest)
        assert refined.chunkstar_budget == 200 * MIB and refined.chunkstar_activations == rows[name].spec.chunkstar_activations
    # a failed or missing free row: the pressured rows are not run, and say why
    with pytest.raises(Unrunnable, match="hf-checkpointing-free did not measure"):
        act.sizing(TINY, {"keep-free": keep, "hf-checkpointing-free": _dme(hf.spec, 1)})
    with pytest.raises(Unrunnable, match="keep-free did not measure"):
        act.sizing(TINY, {"hf-checkpointing-free": hf})
    # a given budget wins, without the free rows
    fixed = dataclasses.replace(TINY, pressure_budget_bytes=123 * MIB)
    assert act.sizing(fixed, {}).budget == 123 * MIB and "as given" in act.sizing(fixed, {}).describe()
    assert [r.spec.chunkstar_budget for r in act.rows(fixed, ["auto"])] == [123 * MIB]
    with pytest.raises(ValueError, match="sized on keep-free and hf-checkpointing-free"):
        act.rows(TINY, ["keep-free", "auto"])
    with pytest.raises(ValueError, match="unknown rows"):
        act.rows(TINY, ["recompute-everything"])
    with pytest.raises(ValueError, match="seq_len 256 is not within cpu-tiny's 1-128 positions"):
        act.rows(dataclasses.replace(TINY, search_seqs=(32, 256)))


def test_a_row_whose_budget_cannot_be_sized_is_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fake(spec: RunSpec, timeout_s: float) -> RunRecord:
        ran.append("hf" if spec.hf_checkpointing else "keep")
        return _dme(spec, 5) if spec.hf_checkpointing else _ok(spec, 1.0, 300)

    monkeypatch.setattr(rounds, "run", fake)
    pooled = rounds.run_rows(act.rows(TINY, ["keep-free", "hf-checkpointing-free", "offload"]), 1, 60.0)
    assert ran == ["keep", "hf"]  # offload never started
    assert pooled["offload"].failure is not None and "not run: the pressured budget" in pooled["offload"].failure.message


def _pooled(name: str, record: RunRecord) -> Pooled:
    return Pooled(Row(name, name, record.spec), [record])


def test_targets_pair_the_issues_rows() -> None:
    specs = {r.name: r.spec for r in act.rows(dataclasses.replace(TINY, pressure_budget_bytes=MIB))}
    times = {"keep-free": 1.0, "hf-checkpointing-free": 1.3, "hf-checkpointing": 2.0, "offload": 1.8, "auto": 1.5, "auto-free": 1.01}
    pooled = {name: _pooled(name, _ok(specs[name], t, 1)) for name, t in times.items()}
    pooled["keep"] = _pooled("keep", _dme(specs["keep"], 2))
    got = {v.target.name: (v.value, v.verdict) for v in judge(act.TARGETS, pooled)}
    assert got == {
        "step time auto / hf-checkpointing (pressured)": (pytest.approx(0.75), "PASS"),
        "step time auto / offload (pressured)": (pytest.approx(1.5 / 1.8), "PASS"),
        "step time auto-free / keep-free": (pytest.approx(1.01), "PASS"),
        "step time offload / hf-checkpointing (pressured)": (pytest.approx(0.9), "-"),
        "step time hf-checkpointing-free / keep-free": (pytest.approx(1.3), "-"),
    }
    # each bound is the issue's: just past it is a MISS of that target alone
    for changed, target in (
        ({"auto": 1.71}, "step time auto / hf-checkpointing (pressured)"),  # 0.855x
        ({"offload": 1.5}, "step time auto / offload (pressured)"),  # 1.00x: not faster
        ({"auto-free": 1.03}, "step time auto-free / keep-free"),
    ):
        worse = dict(pooled, **{name: _pooled(name, _ok(specs[name], t, 1)) for name, t in changed.items()})
        missed = [v.target.name for v in judge(act.TARGETS, worse) if v.verdict == "MISS"]
        assert missed == [target], (changed, missed)
    bounds = {(t.numerator, t.denominator): (t.op, t.limit) for t in act.TARGETS if t.op is not None}
    assert bounds == {("auto", "hf-checkpointing"): ("<=", 0.85), ("auto", "offload"): ("<", 1.0), ("auto-free", "keep-free"): ("<=", 1.02)}


def test_search_stops_at_the_first_misfit_and_reuses_the_table_row() -> None:
    budget = 200 * MIB
    settings = dataclasses.replace(TINY, pressure_budget_bytes=budget, search_seqs=(96, 32, 48, 64))  # in any order
    rows = {r.name: r for r in act.rows(settings)}
    pooled = {
        "hf-checkpointing": _pooled("hf-checkpointing", _ok(rows["hf-checkpointing"].spec, 2.0, 80 * MIB)),
        "auto": _pooled("auto", _ok(rows["auto"].spec, 1.5, 90 * MIB)),
    }
    calls: list[RunSpec] = []
    limit = {"hf-checkpointing": 64, "auto": 96}  # the longest each fits

    def runner(spec: RunSpec, timeout_s: float) -> RunRecord:
        calls.append(spec)
        name = "hf-checkpointing" if spec.hf_checkpointing else "auto"
        return _ok(spec, 1.0, 1) if spec.seq <= limit[name] else _dme(spec, 999 * MIB)

    seen: list[str] = []
    found = act.search(settings, budget, pooled, 60.0, on_record=lambda row, rec: seen.append(row.name), runner=runner)
    assert [(a.seq, a.outcome, a.from_table) for a in found["hf-checkpointing"]] == [
        (32, "fits", True), (48, "fits", False), (64, "fits", False), (96, "DeviceMemoryError", False),
    ]
    assert [a.seq for a in found["auto"]] == [32, 48, 64, 96] and all(a.fits for a in found["auto"])
    assert found["hf-checkpointing"][-1].cell() == "DME (needs 999)"
    # six runs (the table answered for seq 32), each at the budget, with its row's policy and short warm-up
    assert [(s.seq, s.hf_checkpointing, s.chunkstar_activations) for s in calls] == [
        (48, True, None), (64, True, None), (96, True, None), (48, False, "auto"), (64, False, "auto"), (96, False, "auto"),
    ]
    assert all(s.chunkstar_budget == budget for s in calls)
    assert {(s.hf_checkpointing, s.warmup, s.steps) for s in calls} == {(True, 1, 1), (False, 2, 1)}
    assert seen == [f"longest-seq {'hf-checkpointing' if s.hf_checkpointing else 'auto'} {s.seq}" for s in calls]
    assert act.longest(found["hf-checkpointing"]) == 64 and act.longest(found["auto"]) == 96
    verdict = act.judge_search(found)
    assert verdict is not None and verdict.value == 1.5 and verdict.verdict == "PASS"
    # auto fitting less than checkpointing is the target's MISS; nothing fitting for either, n/a
    swapped = {"hf-checkpointing": found["auto"], "auto": found["hf-checkpointing"]}
    assert (v := act.judge_search(swapped)) is not None and v.verdict == "MISS"
    none = [act.Attempt("auto", 32, "DeviceMemoryError")]
    assert (v := act.judge_search({"auto": none, "hf-checkpointing": none})) is not None and v.verdict == "n/a"
    assert act.judge_search({"auto": none}) is None


# --------------------------------------------------------------------------- the command, over a stand-in runner

_NEEDS_MIB = {"keep": 300, "hf": 80, "offload": 90, "auto": 60}
"""What each policy needs at seq 32 (MiB), in proportion to the sequence; auto under pressure plans within it."""
_STEP_S = {"keep": 1.0, "hf": 1.3, "offload": 1.1, "auto": 1.05}


def _stand_in(spec: RunSpec, timeout_s: float, *, echo: bool = True) -> RunRecord:
    kind = "hf" if spec.hf_checkpointing else spec.chunkstar_activations or "keep"
    budget = spec.chunkstar_budget
    assert isinstance(budget, int), spec
    needs = _NEEDS_MIB[kind] * MIB * spec.seq // 32
    if needs > budget:
        return _dme(spec, needs)
    free = budget > 1000 * MIB
    step = 1.0 if kind == "auto" and free else _STEP_S[kind]  # auto keeps everything when it all fits
    blocks = {"keep": 2, "checkpoint": 0, "offload": 0} if free else {"keep": 1, "checkpoint": 0, "offload": 1}
    stats: dict[str, Any] = {"activation_blocks": blocks} if kind in ("auto", "offload") else {}
    if kind == "auto":
        stats["activation_plan"] = {"blocks": {"transformer.h.0": "offload", "transformer.h.1": "keep"}, "link_bytes_per_second": 8e9}
        stats["activation_step_bytes_to_host"] = stats["activation_step_bytes_to_device"] = 0 if free else 3 * MIB
    return _ok(spec, step, needs, **stats)


def test_the_command_end_to_end_over_a_stand_in_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(rounds, "run", _stand_in)
    monkeypatch.setattr(act, "run", _stand_in)
    out = tmp_path / "act.json"
    argv = ["activations", "--model", "cpu-tiny", "--seq", "32", "--search-seqs", "32,48,64,96", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "pressured budget: 190.0 MiB = hf-checkpointing-free's need 80.0 MiB + 0.5 x (keep-free's need 300.0 MiB" in text
    table, rest = text.split("\ncomparison ", 1)
    lines = {ln.split()[0]: ln for ln in table.splitlines() if ln.split() and ln.split()[0] in act.ROW_NAMES}
    assert list(lines) == list(act.ROW_NAMES)
    assert "DeviceMemoryError, needs 300.0 MiB" in lines["keep"] and " 190.0 " in lines["keep"]
    assert "HF checkpointing" in lines["hf-checkpointing"] and "0/2/0 (HF)" in lines["hf-checkpointing"]
    assert " 1/0/1 " in lines["auto"] and " 3.0 " in lines["auto"] and " 2/0/0 " in lines["auto-free"]
    assert lines["keep-free"].split()[-1] == lines["auto"].split()[-1] == "9.4000"  # step 7's loss, in every row
    expected = {
        "step time auto / hf-checkpointing (pressured)": "PASS",  # 1.05 / 1.3
        "step time auto / offload (pressured)": "PASS",  # 1.05 / 1.1
        "step time auto-free / keep-free": "PASS",
        "step time offload / hf-checkpointing (pressured)": "-",
        "step time hf-checkpointing-free / keep-free": "-",
        "longest sequence auto / hf-checkpointing": "PASS",  # 96 (60 MiB x 3 fits 190) against 64 (80 x 2)
    }
    for name, verdict in expected.items():
        found = [ln for ln in rest.splitlines() if ln.startswith(name)]
        assert len(found) == 1 and found[0].split()[-1] == verdict, (name, text)
    search = [ln.split() for ln in rest.splitlines() if ln.startswith(("hf-checkpointing ", "auto "))]
    assert search[0] == ["hf-checkpointing", "fits", "fits", "fits", "DME", "(needs", "240)", "64"], text
    assert search[1] == ["auto", "fits", "fits", "fits", "fits", "96", "(the", "longest", "searched)"], text
    document = json.loads(out.read_text())
    assert document["benchmark"] == "activations" and document["pressured_budget"]["budget"] == 190 * MIB
    assert [a["outcome"] for a in document["longest_sequence"]["hf-checkpointing"]] == ["fits"] * 3 + ["DeviceMemoryError"]
    assert document["rows"]["keep"]["records"][0]["status"] == "oom"
    assert {c["name"]: c["verdict"] for c in document["comparisons"]}["longest sequence auto / hf-checkpointing"] == "PASS"


def test_the_command_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--systems", "keep,recompute"], "unknown ['recompute']"),
        (["--model", "cpu-tiny", "--seq", "64", "--search-seqs", "64,4096"], "seq_len 4096 is not within"),
        (["--systems", "auto"], "sized on keep-free and hf-checkpointing-free"),
        (["--search-seqs", "a,b"], "not a list of integers"),
        (["--pressure-fraction", "1.5"], "within (0, 1)"),
    ):
        with pytest.raises(SystemExit):
            main(["activations", *argv])
        assert message in capsys.readouterr().err, argv


def test_a_device_memory_error_keeps_its_figures() -> None:
    """The record's message is cut at 500 characters, before the smallest budget the error names:
    the child hands the figures over, and the runner keeps them in a failed record's details."""
    from chunkstar import DeviceMemoryError
    from chunkstar_bench import runner
    from chunkstar_bench.child import _device_memory_error

    exc = DeviceMemoryError("cpu", needed=10, free=5, budget=100, where="x" * 600, minimum=123)
    figures = _device_memory_error(exc)
    assert figures is not None and figures["minimum_budget_bytes"] == 123 and figures["budget_bytes"] == 100
    assert _device_memory_error(MemoryError()) is None
    spec = act.rows(TINY, ["keep-free"])[0].spec
    record = RunRecord(spec=spec, status="error", details={"sampled_peak_group_rss_bytes": None})
    failed = {"rank": 0, "status": "oom", "message": "DeviceMemoryError: ...", "device_memory_error": figures, "peak_host_bytes": 1}
    done = runner._finish(record, [failed], None, 1, [], 60.0)
    assert done.status == "oom" and done.details["device_memory_error"]["minimum_budget_bytes"] == 123
    assert act.attempt_of("keep", 32, done).needs == 123


def test_a_ratio_that_rounds_to_its_limit_shows_a_third_place() -> None:
    """0.853 against <= 0.85 is a MISS; printed "0.85x" it would read as a PASS."""
    from chunkstar_bench.comparisons.rounds import Target, Verdict, verdict_table

    t = Target("auto", "hf-checkpointing", "step", "<=", 0.85)
    cells = [ln.split()[-4] for ln in verdict_table([Verdict(t, 0.853, "MISS"), Verdict(t, 0.85, "PASS"), Verdict(t, 0.7, "PASS")]).splitlines()[2:]]
    assert cells == ["0.853x", "0.85x", "0.70x"]
