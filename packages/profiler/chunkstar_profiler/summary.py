"""A text summary of a profile: where bytes moved, where time stalled, peaks."""

from __future__ import annotations

import pandas as pd

from chunkstar_profiler.profile import Profile

__all__ = ["summarize", "operator_table"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def operator_table(profile: Profile) -> pd.DataFrame:
    """Per module: moves and bytes each way, stall time (time spent in moves), by reason."""
    mv = profile.moves
    if mv.empty:
        return pd.DataFrame(columns=["module", "moves", "bytes_to_device", "bytes_to_host", "bytes", "stall_s"])
    to_dev = mv["dst"] == "device"
    g = mv.assign(
        bytes_to_device=mv["nbytes"].where(to_dev, 0), bytes_to_host=mv["nbytes"].where(~to_dev, 0)
    ).groupby("module", sort=False)
    table = pd.DataFrame(
        {
            "moves": g.size(),
            "bytes_to_device": g["bytes_to_device"].sum(),
            "bytes_to_host": g["bytes_to_host"].sum(),
            "bytes": g["nbytes"].sum(),
            "stall_s": g["duration_s"].sum(),
        }
    )
    reasons = mv.pivot_table(index="module", columns="reason", values="nbytes", aggfunc="size", fill_value=0)
    table = table.join(reasons.add_prefix("n_"), how="left").fillna(0)
    return table.reset_index()


def summarize(profile: Profile, top: int = 10) -> str:
    m = profile.meta
    lines = [
        f"profile of {m.get('model_name')} ({m.get('n_params', 0):,} params) on {m.get('device')}, "
        f"{m.get('precision')}, {m.get('iterations')} iteration(s)",
        f"budget {_mib(m.get('budget_bytes', 0))}, {m.get('n_chunks')} chunks of {m.get('chunk_size', 0):,} elements, "
        f"model data {_mib(m.get('model_data_bytes', 0))}",
        "",
    ]
    mv = profile.moves
    to_dev = mv[mv["dst"] == "device"]
    to_host = mv[mv["dst"] == "host"]
    lines.append("totals")
    lines.append(f"  moves to device      {len(to_dev):>8}  {_mib(to_dev['nbytes'].sum()):>14}  {to_dev['duration_s'].sum():8.3f} s")
    lines.append(f"  moves to host        {len(to_host):>8}  {_mib(to_host['nbytes'].sum()):>14}  {to_host['duration_s'].sum():8.3f} s")
    for reason, grp in mv.groupby("reason"):
        lines.append(f"  {reason:<20} {len(grp):>8}  {_mib(grp['nbytes'].sum()):>14}")
    if not profile.stages.empty:
        st = profile.stages.assign(d=profile.stages["t_end_s"] - profile.stages["t_start_s"])
        per = st.groupby("stage")["d"].sum()
        lines.append("  time by stage        " + ", ".join(f"{k} {v:.3f} s" for k, v in per.items()))
    lines.append("")
    lines.append("peak memory per tier")
    for tier, grp in profile.memory.groupby("tier"):
        lines.append(
            f"  {tier:<8} total {_mib(grp['total_bytes'].max()):>12}  chunks {_mib(grp['chunk_bytes'].max()):>12}  "
            f"non-model {_mib(grp['non_model_bytes'].max()):>12}"
        )
    ops = operator_table(profile)
    if not ops.empty:
        lines.append("")
        lines.append(f"top {top} operators by bytes moved")
        for r in ops.sort_values("bytes", ascending=False).head(top).itertuples(index=False):
            lines.append(f"  {r.module:<40} {int(r.moves):>6} moves  {_mib(r.bytes):>12}  stall {r.stall_s:8.4f} s")
        lines.append("")
        lines.append(f"top {top} operators by stall time (time inside chunk moves)")
        for r in ops.sort_values("stall_s", ascending=False).head(top).itertuples(index=False):
            lines.append(f"  {r.module:<40} stall {r.stall_s:8.4f} s  {int(r.moves):>6} moves  {_mib(r.bytes):>12}")
    return "\n".join(lines)
