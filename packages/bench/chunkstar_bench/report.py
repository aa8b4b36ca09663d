"""Text tables from a results database, shaped like the PatrickStar paper's figures.

Three views, each a function returning text:

* :func:`runs_table` -- every (latest) run: status, step time, tokens/s, TFLOPS
  under both FLOP counts, MFU, peak host/device memory;
* :func:`paper_tables` -- per hardware and system, rows = model size, columns
  = GPU count, cells = TFLOPS per GPU by PatrickStar's count (8*N*B*s): ours,
  and beside it the published figure (:mod:`chunkstar_bench.published`),
  always under a heading that says "published (PatrickStar README, read off
  plots)" -- never as a result of this project;
* :func:`maxscale_table` -- for each system and host-memory cap, the largest
  model that trained, and the attempts that did not.

This module reads a :class:`~chunkstar_bench.results.ResultsDB`; it runs nothing.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from chunkstar_bench.published import SOURCE, load_published, parse_label, published_for, system_info
from chunkstar_bench.tables import text_table
from chunkstar_bench.units import GIB
from chunkstar_bench.zoo import ZOO, paper_label

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["PUBLISHED_LABEL", "maxscale_table", "paper_tables", "published_table", "report", "runs_table"]

PUBLISHED_LABEL = SOURCE
"""The heading of every published figure (:data:`chunkstar_bench.published.SOURCE`)."""
_KEY = ["suite", "system", "model", "hardware", "nprocs", "batch", "seq_len"]


def _row_name(config_json: str, system: str) -> str:
    """The comparison row a run was (``chunkstar-pressure``), or its system for a suite's run."""
    return str(json.loads(config_json).get("details", {}).get("row") or system)


def _latest(df: pd.DataFrame) -> pd.DataFrame:
    """The newest row of each (suite, system, model, hardware, nprocs, batch, seq_len) and comparison row."""
    df = df.assign(_row=[_row_name(c, s) for c, s in zip(df["config_json"], df["system"])])
    return df.sort_values("id").groupby([*_KEY, "_row"], as_index=False, sort=False).tail(1)


def _gib(value: Any) -> str:
    return "-" if value is None or value != value else f"{float(value) / GIB:.2f}"  # NaN != NaN


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None or value != value else format(float(value), fmt)


def _is_cpu(hardware: str) -> bool:
    return hardware == "cpu" or hardware.startswith("cpu-")


def runs_table(df: pd.DataFrame) -> str:
    """The latest run of each configuration, one table per suite and hardware, largest model
    last. CPU runs show time and tokens; TFLOPS per GPU and MFU only where there is a GPU."""
    if df.empty:
        return "(no runs)"
    latest = _latest(df)
    parts = []
    for (suite, hardware), group in latest.groupby(["suite", "hardware"], sort=True):
        gpu = not _is_cpu(str(hardware))
        headers = ["system", "model", "params", "procs", "batch x seq", "status", "s/step", "tokens/s"]
        headers += ["TFLOPS/GPU (8NBs)", "TFLOPS/GPU (Megatron)", "MFU"] if gpu else []
        headers += ["peak host GiB", "peak device GiB", "other load"]
        rows = []
        for _, r in group.sort_values(["n_params", "nprocs", "system"]).iterrows():
            row = [
                r["system"] if r["_row"] == r["system"] else f"{r['system']} [{r['_row']}]", str(r["model"]),
                f"{r['n_params'] / 1e6:,.1f}M" if r["n_params"] == r["n_params"] else "-", str(r["nprocs"]),
                f"{r['batch']} x {r['seq_len']}", str(r["status"]), _num(r["step_time_s"], ".3f"), _num(r["tokens_per_s"], ",.0f"),
            ]  # fmt: skip
            if gpu:
                row += [_num(r["tflops_per_gpu_patrickstar"], ".1f"), _num(r["tflops_per_gpu_megatron"], ".1f"), _num(r["mfu"], ".1%")]
            row += [
                _gib(r["peak_host_bytes"]), _gib(r["peak_device_bytes"]),
                _num(json.loads(r["config_json"]).get("details", {}).get("other_load_cores"), ".2f"),
            ]  # fmt: skip
            rows.append(row)
        parts.append(f"## {suite} on {hardware}\n{text_table(headers, rows)}")
    errors = [f"  {r['_row']} {r['model']} x{r['nprocs']}: {r['status']}: {r['message']}"
              for _, r in latest.iterrows() if r["status"] != "ok"]  # fmt: skip
    notes = (
        "TFLOPS/GPU (8NBs) = 8*params*batch*seq per step (PatrickStar's count); Megatron = 24*3*B*s*L*h^2*(1+s/6h+V/16Lh) "
        "(no recompute); neither is shown for CPU runs.\n"
        "other load = cores kept busy by other processes during the timed steps (above ~0.25 on a small machine: "
        "step times not trustworthy)."
    )
    return "\n\n".join(parts) + "\n\n" + notes + ("\n\nnot ok:\n" + "\n".join(errors) if errors else "")


def _size_label(model: str) -> str:
    spec = ZOO.get(model)
    return (paper_label(spec) if spec is not None else None) or model


def published_table(hardware: str, system: str) -> pd.DataFrame | None:
    """Published TFLOPS per GPU (8*N*B*s) for one node and published system: rows = size label, columns = GPUs."""
    import pandas as pd

    rows = [
        {"model": r.label, "gpus": r.gpus, "per_gpu": r.tflops_per_gpu}
        for r in load_published()
        if r.hardware == hardware and r.system == system
    ]
    if not rows:
        return None
    df = pd.DataFrame(rows)
    order = list(dict.fromkeys(df["model"]))
    table = df.pivot_table(index="model", columns="gpus", values="per_gpu", aggfunc="first")
    return table.reindex(order)


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def paper_tables(df: pd.DataFrame, hardware: str | None = None) -> str:
    """Ours beside published, per (GPU hardware, system): rows = model size, for each GPU
    count a column of ours and one of the published figure. CPU runs have no such table
    (nothing is published for a CPU, and TFLOPS per GPU would not mean anything there)."""
    parts: list[str] = []
    ok = df[df["status"] == "ok"] if not df.empty else df
    hardwares = [hardware] if hardware else sorted(set(df["hardware"])) if not df.empty else []
    published_hw = {r.hardware for r in load_published()}
    cpu = [hw for hw in hardwares if _is_cpu(hw)]
    for hw in (h for h in hardwares if not _is_cpu(h)):
        sub = ok[ok["hardware"] == hw] if not ok.empty else ok
        systems = sorted(set(sub["system"])) if not sub.empty else []
        if hw in published_hw:
            systems = sorted(set(systems) | {"chunkstar", "deepspeed"})
        for system in systems:
            ours: dict[tuple[str, int], float] = {}
            sizes: list[tuple[int, str]] = []
            mine = sub[sub["system"] == system] if not sub.empty else sub
            if not mine.empty:
                for _, r in _latest(mine).iterrows():
                    label = _size_label(str(r["model"]))
                    ours[(label, int(r["nprocs"]))] = float(r["tflops_per_gpu_patrickstar"])
                    sizes.append((int(r["n_params"]), label))
            pub_system = published_for(system)
            pub = published_table(hw, pub_system) if pub_system is not None else None
            published: dict[tuple[str, int], float] = {}
            if pub is not None:
                for label in pub.index:
                    for gpus in pub.columns:
                        value = pub.loc[label, gpus]
                        if value == value:  # not NaN
                            published[(str(label), int(gpus))] = float(value)
                            sizes.append((parse_label(str(label)), str(label)))
            if not ours and not published:
                continue
            order = list(dict.fromkeys(label for _, label in sorted(sizes)))
            counts = sorted({g for _, g in ours} | {g for _, g in published})
            headers = ["model"]
            for g in counts:
                headers += [f"{_gpus(g)} ours", f"{_gpus(g)} published"] if pub is not None else [f"{_gpus(g)} ours"]
            rows = []
            for label in order:
                row = [label]
                for g in counts:
                    row.append(_num(ours.get((label, g)), ".1f"))
                    if pub is not None:
                        row.append(_num(published.get((label, g)), ".1f"))
                rows.append(row)
            source = f"the published columns: {system_info(pub_system).label}, {PUBLISHED_LABEL}" if pub is not None and pub_system else (
                "no published numbers for this hardware" if hw not in published_hw else "no published numbers for this system"
            )
            parts.append(
                f"== {hw} / {system_info(system).label}: TFLOPS per GPU, 8*N*B*s\n{text_table(headers, rows)}\n"
                f"({'ours: no successful runs; ' if not ours else ''}{source})"
            )
    if cpu:
        parts.append(f"({', '.join(cpu)}: no paper-shaped table for CPU runs; their times are in the runs above, "
                     "and nothing is published for a CPU)")  # fmt: skip
    return "\n\n".join(parts) if parts else "(no runs)"


def maxscale_table(df: pd.DataFrame) -> str:
    """Largest model that trained, per system and host-memory cap, from the ``max-scale`` suite's rows."""
    ms = df[df["suite"] == "max-scale"] if not df.empty else df
    if ms.empty:
        return "(no max-scale attempts)"
    ms = ms.copy()
    specs = [json.loads(c).get("spec", {}) for c in ms["config_json"]]
    ms["cap"] = [spec.get("host_mem_cap_bytes") for spec in specs]
    # deepspeed-nvme with its params on disk too is a different offload: its own row
    ms["system"] = [f"{system}+params" if spec.get("nvme_params") else system for system, spec in zip(ms["system"], specs)]
    rows = []
    for (system, hardware, cap), group in ms.groupby(["system", "hardware", "cap"], sort=True):
        good = group[group["status"] == "ok"].sort_values("n_params")
        bad = group[group["status"] != "ok"].sort_values("n_params")
        best = good.iloc[-1] if not good.empty else None
        first_bad = bad.iloc[0] if not bad.empty else None
        rows.append({
            "system": system, "hardware": hardware,  # the --system names, as typed
            "host cap GiB": f"{cap / GIB:.2f}" if cap else "none",
            "largest trained": "none" if best is None else f"{best['model']} ({best['n_params'] / 1e6:,.1f}M)",
            "its peak RSS GiB": "-" if best is None else _gib(best["peak_host_bytes"]),
            "smallest failed": "-" if first_bad is None else f"{first_bad['model']} ({first_bad['n_params'] / 1e6:,.1f}M, {first_bad['status']})",
            "attempts": len(group),
        })
    return text_table(list(rows[0]), [[str(v) for v in r.values()] for r in rows])


def report(df: pd.DataFrame, hardware: str | None = None) -> str:
    """The full text report: runs, paper-shaped tables, max-scale."""
    if hardware is not None and not df.empty:
        df = df[df["hardware"] == hardware]
    suites = df[df["suite"] != "max-scale"] if not df.empty else df
    return "\n\n".join([
        "# Runs (latest of each configuration)", runs_table(suites),
        "# Paper-shaped tables", paper_tables(suites, hardware),
        "# Max-scale search", maxscale_table(df),
    ])
