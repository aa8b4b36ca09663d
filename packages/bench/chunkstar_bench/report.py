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

from chunkstar_bench.published import SOURCE, load_published, published_for
from chunkstar_bench.zoo import ZOO, paper_label

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["PUBLISHED_LABEL", "maxscale_table", "paper_tables", "published_table", "report", "runs_table"]

PUBLISHED_LABEL = SOURCE
"""The heading of every published figure (:data:`chunkstar_bench.published.SOURCE`)."""
_GIB = 2**30
_KEY = ["suite", "system", "model", "hardware", "nprocs", "batch", "seq_len"]


def _row_name(config_json: str, system: str) -> str:
    """The comparison row a run was (``chunkstar-pressure``), or its system for a suite's run."""
    return str(json.loads(config_json).get("details", {}).get("row") or system)


def _latest(df: pd.DataFrame) -> pd.DataFrame:
    """The newest row of each (suite, system, model, hardware, nprocs, batch, seq_len) and comparison row."""
    df = df.assign(_row=[_row_name(c, s) for c, s in zip(df["config_json"], df["system"])])
    return df.sort_values("id").groupby([*_KEY, "_row"], as_index=False, sort=False).tail(1)


def _gib(value: Any) -> str:
    return "-" if value is None or value != value else f"{float(value) / _GIB:.2f}"  # NaN != NaN


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None or value != value else format(float(value), fmt)


def runs_table(df: pd.DataFrame) -> str:
    """One line per run (latest of each configuration), largest model last within a suite."""
    import pandas as pd

    if df.empty:
        return "(no runs)"
    rows = []
    for _, r in _latest(df).sort_values(["suite", "hardware", "n_params", "nprocs", "system"]).iterrows():
        rows.append({
            "suite": r["suite"], "hardware": r["hardware"],
            "system": r["system"] if r["_row"] == r["system"] else f"{r['system']} [{r['_row']}]", "model": r["model"],
            "params": f"{r['n_params'] / 1e6:,.1f}M" if r["n_params"] == r["n_params"] else "-",
            "procs": r["nprocs"], "batch x seq": f"{r['batch']}x{r['seq_len']}", "status": r["status"],
            "s/step": _num(r["step_time_s"], ".3f"), "tokens/s": _num(r["tokens_per_s"], ",.0f"),
            "TFLOPS/GPU 8NBs": _num(r["tflops_per_gpu_patrickstar"], ".4f"),
            "TFLOPS/GPU megatron": _num(r["tflops_per_gpu_megatron"], ".4f"),
            "MFU": _num(r["mfu"], ".1%"), "peak host GiB": _gib(r["peak_host_bytes"]),
            "peak dev GiB": _gib(r["peak_device_bytes"]),
            "other load": _num(json.loads(r["config_json"]).get("details", {}).get("other_load_cores"), ".2f"),
        })
    table = pd.DataFrame(rows).to_string(index=False)
    errors = [f"  {r['_row']} {r['model']} x{r['nprocs']}: {r['status']}: {r['message']}"
              for _, r in _latest(df).iterrows() if r["status"] != "ok"]
    notes = ("\nTFLOPS/GPU 8NBs = 8*params*batch*seq per step (PatrickStar's count); megatron = 24*3*B*s*L*h^2*(1+s/6h+V/16Lh) (no recompute).\n"
             "other load = cores kept busy by other processes during the timed steps (above ~0.25 on a small machine: step times not trustworthy).")
    return table + notes + ("\nnot ok:\n" + "\n".join(errors) if errors else "")


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


def paper_tables(df: pd.DataFrame, hardware: str | None = None) -> str:
    """Ours beside published, per (hardware, system) found in ``df`` (or the given hardware)."""
    import pandas as pd

    parts: list[str] = []
    ok = df[df["status"] == "ok"] if not df.empty else df
    hardwares = [hardware] if hardware else sorted(set(df["hardware"])) if not df.empty else []
    published_hw = {r.hardware for r in load_published()}
    for hw in hardwares:
        sub = ok[ok["hardware"] == hw] if not ok.empty else ok
        systems = sorted(set(sub["system"])) if not sub.empty else []
        if hw in published_hw:
            systems = sorted(set(systems) | {"chunkstar", "deepspeed"})
        for system in systems:
            ours = sub[sub["system"] == system] if not sub.empty else sub
            title = f"== {hw} / {system}: TFLOPS per GPU, 8*N*B*s (rows = model, columns = GPUs)"
            if not ours.empty:
                ours = _latest(ours).copy()
                ours["size"] = [_size_label(m) for m in ours["model"]]
                ours = ours.sort_values("n_params")
                mine = ours.pivot_table(index="size", columns="nprocs", values="tflops_per_gpu_patrickstar", aggfunc="last")
                mine = mine.reindex(list(dict.fromkeys(ours["size"])))
                body = f"ours:\n{mine.to_string(float_format=lambda v: f'{v:.4g}')}"
            else:
                body = "ours: (no successful runs)"
            pub_system = published_for(system)
            pub = published_table(hw, pub_system) if pub_system is not None else None
            if pub is not None:
                body += f"\n{PUBLISHED_LABEL}, {pub_system}:\n{pub.to_string(float_format=lambda v: f'{v:.1f}')}"
            elif hw not in published_hw:
                body += "\n(no published numbers for this hardware)"
            parts.append(f"{title}\n{body}")
    _ = pd  # pandas is needed by the pivots above
    return "\n\n".join(parts) if parts else "(no runs)"


def maxscale_table(df: pd.DataFrame) -> str:
    """Largest model that trained, per system and host-memory cap, from the ``max-scale`` suite's rows."""
    import pandas as pd

    ms = df[df["suite"] == "max-scale"] if not df.empty else df
    if ms.empty:
        return "(no max-scale attempts)"
    ms = ms.copy()
    specs = [json.loads(c)["spec"] for c in ms["config_json"]]
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
            "system": system, "hardware": hardware, "host cap GiB": f"{cap / _GIB:.2f}" if cap else "none",
            "largest trained": "none" if best is None else f"{best['model']} ({best['n_params'] / 1e6:,.1f}M)",
            "its peak RSS GiB": "-" if best is None else _gib(best["peak_host_bytes"]),
            "smallest failed": "-" if first_bad is None else f"{first_bad['model']} ({first_bad['n_params'] / 1e6:,.1f}M, {first_bad['status']})",
            "attempts": len(group),
        })
    return pd.DataFrame(rows).to_string(index=False)


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
