"""``benchmarks/gpu_check.py`` (``./dev gpu-check``) kept correct on CPU.

``--smoke`` runs every row of the GPU check (the API probes, parity under
eviction, and the pressured / capped / resident throughput rows, each in its
own subprocess) with tiny models on chunkstar's CPU virtual device: the real
engine, no stubs. It runs once, as on the GPU machine: DeepSpeed, psutil,
pandas and the other extras cannot be imported and no package index can be
reached. Without CUDA and without ``--smoke`` the script must refuse in one line.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
ROWS = ["api", "parity fp32", "parity bf16", "tiny-a overlap", "tiny-a serial", "tiny-b capped", "tiny-a resident"]
COLUMNS = ["status", "s/step", "TFLOPS", "MFU", "to dev/step", "to host/step", "hidden", "real peak", "reserved", "budget", "notes"]
BLOCKED = ("deepspeed", "psutil", "pandas", "streamlit", "plotly", "pytest", "accelerate", "peft", "pyarrow")
"""Not on the GPU machine (or not to be relied on there): the smoke run cannot import them."""

_SITECUSTOMIZE = f"""\
# test_gpu_check_script: the GPU machine's environment, where these are not installed.
# A None in sys.modules makes `import name` fail and importlib.util.find_spec(name) say None,
# as for a package that is not there (transformers then takes it for absent, too).
import sys
for _name in {BLOCKED!r}:
    sys.modules[_name] = None
"""


def _gpu_machine_env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(PIP_NO_INDEX="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _table_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The main table's rows by run name (cells split on runs of two or more spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run ") and " status " in line)
    rows: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        assert len(cells) == 1 + len(COLUMNS), line
        rows[cells[0]] = dict(zip(COLUMNS, cells[1:]))
    return rows


@pytest.fixture(scope="module")
def gpu_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _gpu_machine_env(tmp_path_factory.mktemp("gpu_machine_site"))


@pytest.fixture(scope="module")
def smoke(gpu_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "gpu_check.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, text=True,
                          timeout=900, env=gpu_env, cwd=tmp)  # fmt: skip
    return {"proc": proc, "json": out, "wall_s": time.monotonic() - t0}


def test_the_environment_blocks_what_the_gpu_machine_lacks(gpu_env: dict[str, str]) -> None:
    code = "import importlib.util; " + "; ".join(
        f"assert importlib.util.find_spec({name!r}) is None, {name!r}" for name in BLOCKED
    ) + "; import torch, transformers, safetensors"  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=gpu_env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_smoke_passes_on_the_gpu_machines_environment(smoke: dict[str, Any]) -> None:
    proc = smoke["proc"]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-6000:]
    assert proc.stdout.startswith("chunkstar gpu-check --smoke: ")  # versions first
    first = proc.stdout.splitlines()[0]
    assert f"torch {torch.__version__}" in first and "transformers" in first and "safetensors" in first
    rows = _table_rows(proc.stdout)
    assert list(rows) == ROWS, proc.stdout
    for name in ROWS:
        assert rows[name]["status"] == "PASS", proc.stdout
    assert "[gpu-check 7/7]" in proc.stderr  # progress on stderr


def test_smoke_rows(smoke: dict[str, Any]) -> None:
    proc = smoke["proc"]
    rows = _table_rows(proc.stdout)
    throughput = ["tiny-a overlap", "tiny-a serial", "tiny-b capped", "tiny-a resident"]
    for name in throughput:
        float(rows[name]["s/step"])
        float(rows[name]["TFLOPS"])
        assert rows[name]["MFU"] == "n/a"  # no published peak for a CPU
        assert rows[name]["budget"] != "n/a" and rows[name]["real peak"] != "-", proc.stdout
    assert rows["tiny-a resident"]["to dev/step"] == "0 B", proc.stdout  # the no-movement reference moved nothing
    for name in ("tiny-a overlap", "tiny-a serial", "tiny-b capped"):
        assert rows[name]["to dev/step"] != "0 B" and rows[name]["to host/step"] != "0 B", proc.stdout
    hidden = rows["tiny-a overlap"]["hidden"]
    assert hidden == "n/a" or 0.0 <= float(hidden) <= 1.0, proc.stdout
    assert rows["tiny-a serial"]["hidden"] == "-"
    # the API table: every probe listed, the CUDA ones n/a on this machine
    assert "torch APIs the engine calls:" in proc.stdout
    from chunkstar_bench.torch_api import PROBES

    cuda = sum(p.where == "cuda" for p in PROBES)
    assert rows["api"]["notes"].startswith(f"{len(PROBES) - cuda} ok, 0 failed, {cuda} n/a of {len(PROBES)} probes"), rows["api"]


def test_smoke_record(smoke: dict[str, Any]) -> None:
    record = json.loads(smoke["json"].read_text())
    assert record["passed"] is True
    assert record["flops_formula"].startswith("megatron")
    assert {"python", "torch", "cuda_build", "transformers", "safetensors", "chunkstar"} <= set(record["versions"])
    by_status: dict[str, set[str]] = {}
    for entry in record["api"]:
        by_status.setdefault(entry["status"], set()).add(entry["name"])
    from chunkstar_bench.torch_api import PROBES

    assert by_status["n/a"] == {p.name for p in PROBES if p.where == "cuda"} >= {"streams and events", "cudaHostRegister"}
    assert "FAILED" not in by_status and by_status["ok"] == {p.name for p in PROBES if p.where != "cuda"}
    assert [p["name"] for p in record["plans"]] == ROWS
    results = record["results"]
    assert results["parity fp32"]["max_abs_loss_diff"] <= 1e-5 * max(results["parity fp32"]["reference_losses"])
    for name in ("parity fp32", "parity bf16"):
        assert min(results[name]["moves_to_device_per_step"]) > 0
        assert results[name]["budget_bytes"] < results[name]["param_bytes"] + results[name]["non_model_peak_bytes"]
    overlap, serial, capped = results["tiny-a overlap"], results["tiny-a serial"], results["tiny-b capped"]
    assert overlap["config"]["overlap"] is True and serial["config"]["overlap"] is False
    assert overlap["config"]["device_memory_budget"] == serial["config"]["device_memory_budget"]
    assert overlap["per_timed_step"]["chunk_moves_to_device"] > 0
    assert capped["config"]["device_memory_budget"] < capped["chunkstar_stats"]["model_data_bytes"] / 2
    for name in ROWS[1:]:
        memory = results[name]["memory"]
        assert memory["real_peak_reserved_bytes"] is None  # CUDA only
        if memory["engine_device_peak_bytes"] is not None:  # the virtual device's meter is the real-memory column
            assert memory["real_peak_allocated_bytes"] == memory["engine_device_peak_bytes"]
            assert memory["real_peak_allocated_bytes"] <= 1.05 * memory["budget_room_bytes"], name


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_row_the_deadline_stops_is_a_skip_its_own_limit_a_failure(tmp_path: Path) -> None:
    gc = _load_script()
    plan = gc.Plan(name="api", kind="api", device="cpu", timeout_s=0.2)
    cut = gc._run_child(plan, 0.2, 8 << 30, True)  # importing torch alone takes longer
    assert cut["status"] == "skipped" and "global deadline" in cut["message"], cut
    own = gc._run_child(plan, 0.2, 8 << 30, False)
    assert own["status"] == "timeout", own
    plans = [plan, gc.Plan(name="other", kind="api", device="cpu", timeout_s=1.0)]
    assert gc._passed({"api": cut, "other": {"status": "ok", "verdict": "PASS"}}, plans)
    assert not gc._passed({"api": own, "other": {"status": "ok", "verdict": "PASS"}}, plans)
    assert not gc._passed({"api": cut, "other": {"status": "ok", "verdict": "FAIL"}}, plans)


def test_rows_the_deadline_leaves_no_time_for_are_skipped_and_the_exit_is_0(tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--deadline-s", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = _table_rows(proc.stdout)
    assert list(rows) == ROWS and all(r["status"] == "SKIP" for r in rows.values()), proc.stdout
    assert json.loads(out.read_text())["passed"] is True
    # a SKIP is no failure, so it says why, as it happens and again under the table
    assert f"SKIPPED ({len(ROWS)} of {len(ROWS)} rows" in proc.stdout, proc.stdout
    listed = proc.stdout.split("SKIPPED (", 1)[1].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in listed] == ROWS, proc.stdout
    assert all("global deadline" in line for line in listed), proc.stdout
    assert proc.stderr.count(": SKIP: not started:") == len(ROWS), proc.stderr
    assert f"({len(ROWS)} row(s) SKIPPED, listed under the table)" in proc.stderr, proc.stderr


def test_the_gpu_plans_fit_the_deadline_in_priority_order() -> None:
    gc = _load_script()
    args = gc._parse_args([])
    plans = gc._plans(args)
    assert [p.name for p in plans] == ["api", "parity fp32", "parity bf16", "GPT2-XL overlap", "GPT2-XL serial",
                                       "GPT3_6B capped", "GPT2-XL resident"]  # fmt: skip
    by_name = {p.name: p for p in plans}
    capped = by_name["GPT3_6B capped"]
    assert capped.budget == 24 * 10**9 and capped.steps == 1 and capped.warmup == 2
    assert 14 * gc.n_params(capped.model) > 3.5 * capped.budget  # model data far above the device
    assert by_name["GPT2-XL resident"].budget is None
    xl = by_name["GPT2-XL overlap"]
    assert xl.budget == by_name["GPT2-XL serial"].budget < 14 * gc.n_params(xl.model)
    assert gc._DEFAULT_DEADLINE_S["cuda"] <= 400
    assert all(p.min_start_s < p.timeout_s for p in plans)
    # only the rows asked for (and the API probes)
    assert [p.name for p in gc._plans(gc._parse_args(["--only", "6B"]))] == ["api", "GPT3_6B capped"]


def test_probe_reports_a_missing_api_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkstar_bench import torch_api

    monkeypatch.delattr(torch, "_foreach_norm")
    results = {r["name"]: r for r in torch_api.probe(torch.device("cpu"))}
    assert results["foreach ops"]["status"] == "FAILED"
    assert results["foreach ops"]["detail"].startswith("AttributeError"), results["foreach ops"]
    assert results["fused Adam"]["status"] == "ok"


def _torch_apis_of(source: str) -> set[str]:
    """The torch APIs a module of the engine reaches: ``torch.cuda.*``, ``torch._*``,
    ``torch.distributed.*`` and the other chains :mod:`chunkstar_bench.torch_api` names,
    through the module's own import aliases, plus a few distinctive method names."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in alias:
                found.add(".".join([alias[inner.id], *reversed(parts)]))
            if node.attr in _METHODS:
                found.add("." + node.attr)
        elif isinstance(node, ast.Name) and node.id in alias:
            found.add(alias[node.id])
    watched = ("torch.cuda.", "torch._", "torch.distributed.", "torch.utils._python_dispatch.", "torch.overrides._",
               "torch.utils.swap_tensors", "torch.autograd.graph.")  # fmt: skip
    return {api for api in found if api.startswith(watched) or api.startswith(".")}


_METHODS = {"register_post_accumulate_grad_hook", "record_stream", "wait_event", "wait_stream", "resize_", "is_pinned",
            "pin_memory", "untyped_storage"}  # fmt: skip
_NOT_PROBED = {
    "torch._C": "a module (its members are listed one by one)",
    "torch._dynamo": "torch.compile's, looked up in sys.modules; not a CUDA path",
    "torch._dynamo.eval_frame": "as above",
    "torch.autograd.graph": "a module",
}


def test_probes_cover_every_torch_api_the_engine_calls() -> None:
    from chunkstar_bench.torch_api import COVERED

    used: dict[str, list[str]] = {}
    for path in sorted((REPO / "packages" / "core" / "chunkstar").rglob("*.py")):
        for api in _torch_apis_of(path.read_text()):
            used.setdefault(api, []).append(str(path.relative_to(REPO)))
    assert "torch.cuda.Stream" in used and ".register_post_accumulate_grad_hook" in used  # the scan sees the engine
    missing = {api: files for api, files in used.items() if api not in COVERED and api not in _NOT_PROBED}
    assert not missing, (
        "the engine calls torch APIs that ./dev gpu-check does not probe: add them to "
        f"packages/bench/chunkstar_bench/torch_api.py (PROBES): {missing}"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, ./dev gpu-check runs the whole check")
def test_dev_gpu_check_installs_nothing() -> None:
    """No set-up (which would pip install DeepSpeed): straight to the script, which refuses without CUDA."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PIP_NO_INDEX"] = "1"
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(REPO / "dev"), "gpu-check"], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert "[dev] installing" not in proc.stderr and "pip" not in proc.stderr, proc.stderr
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--smoke" in lines[0], proc.stderr


def test_reserved_memory_past_the_budget_fails_a_row() -> None:
    """Issue 30, item 7: the allocator's reserved peak (cached blocks included) is what a GPU of
    the budget's size would have had to give; past it (and the 5% tolerance) the row FAILs."""
    gc = _load_script()
    meter = SimpleNamespace(cuda=True, base_allocated=0)
    room = 24 * 10**9
    record, failures = gc._memory_verdict(meter, {"allocated": 20 * 10**9, "reserved": 27 * 10**9}, {}, room)
    assert record["real_peak_reserved_bytes"] == 27 * 10**9
    assert len(failures) == 1 and failures[0].startswith("reserved device peak 27.0 GB"), failures
    _, failures = gc._memory_verdict(meter, {"allocated": 20 * 10**9, "reserved": 25 * 10**9}, {}, room)
    assert failures == []  # within 5%
    # the CPU virtual device reserves nothing: no such check there
    cpu = SimpleNamespace(cuda=False, base_allocated=0)
    _, failures = gc._memory_verdict(cpu, {"allocated": None, "reserved": None}, {"device_peak_bytes": 10}, 100)
    assert failures == []


def test_the_6b_row_runs_on_a_128_gb_host_and_is_sized_to_a_smaller_one() -> None:
    """Issue 30, item 7: the 6B row must not go silently. On a 128 GB host it fits as it is;
    on a host that cannot hold its 86 GB of chunks it runs the most blocks of its shape that fit
    (still far above its 24 GB device budget), under its own name, and its note says so."""
    gc = _load_script()
    capped = next(p for p in gc._plans(gc._parse_args([])) if p.mode == "capped")
    cap = int(gc._parse_args([]).host_mem_cap_gib * 2**30)
    host_128gb = 120 * 10**9  # MemAvailable of a 128 GB machine, roughly
    assert gc._host_need(capped) <= min(cap, host_128gb)
    limit = 64 * 2**30
    sized = gc._sized_to_host(capped, limit)
    assert sized is not None and sized.name == capped.name and sized.budget == capped.budget
    assert sized.model.layers < capped.model.layers and gc._host_need(sized) <= limit
    assert gc._host_need(dataclasses.replace(sized, model=dataclasses.replace(sized.model, layers=sized.model.layers + 1))) > limit
    assert 14 * gc.n_params(sized.model) > 2 * sized.budget  # still model data far above the device
    assert f"sized to the host: {sized.model.layers} of {capped.model.layers} blocks" in sized.budget_note
    assert gc._sized_to_host(capped, 16 * 2**30) is None  # too small a host to make the point: a SKIP
