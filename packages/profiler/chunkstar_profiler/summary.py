"""A text summary of a profile: where bytes moved, where time stalled, peaks per tier, the disk tier's I/O,
the activation moves (and, for a predicted profile, a line saying that its times are a time model's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from chunkstar_profiler.profile import MOVE_REASONS, TIERS, Profile

__all__ = ["activation_table", "summarize", "operator_table"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _directions(mv: pd.DataFrame) -> dict[str, pd.Series]:
    """Masks over ``mv`` by direction: to the device, device -> host, disk -> host (stage-in), host -> disk (stage-out)."""
    from_disk = mv["src"] == "disk"
    to_disk = mv["dst"] == "disk"
    return {
        "to_device": mv["dst"] == "device",
        "to_host": (mv["dst"] == "host") & ~from_disk,
        "from_disk": from_disk,
        "to_disk": to_disk,
    }


def operator_table(profile: Profile) -> pd.DataFrame:
    """Per module: moves and bytes each way, stall time (time spent in moves), by reason."""
    mv = profile.moves
    cols = ["module", "moves", "bytes_to_device", "bytes_to_host", "bytes_from_disk", "bytes_to_disk", "bytes", "stall_s"]
    if mv.empty:
        return pd.DataFrame(columns=cols)
    way = _directions(mv)
    g = mv.assign(**{f"bytes_{k}": mv["nbytes"].where(m, 0) for k, m in way.items()}).groupby("module", sort=False)
    table = pd.DataFrame(
        {
            "moves": g.size(),
            **{f"bytes_{k}": g[f"bytes_{k}"].sum() for k in way},
            "bytes": g["nbytes"].sum(),
            "stall_s": g["duration_s"].sum(),
        }
    )
    reasons = mv.pivot_table(index="module", columns="reason", values="nbytes", aggfunc="size", fill_value=0)
    table = table.join(reasons.add_prefix("n_"), how="left").fillna(0)
    return table.reset_index()


def activation_table(profile: Profile) -> pd.DataFrame:
    """Per iteration: the activation moves each way (count and bytes), the copies back issued ahead
    of the backward, and the time from issue to found done. One row per iteration with a stage or an
    activation move (-1: moves outside any moment), so an iteration that moved none shows zeros."""
    am = profile.activation_moves
    cols = ["iteration", "to_host", "bytes_to_host", "to_device", "bytes_to_device", "prefetched", "copy_s"]
    iterations = sorted({int(i) for i in profile.stages["iteration"]} | {int(i) for i in am["iteration"]})
    if am.empty:
        out = pd.DataFrame({c: np.zeros(len(iterations), dtype=np.int64) for c in cols}).astype({"copy_s": float})
        out["iteration"] = iterations
        return out
    to_host, to_device = am["dst"] == "host", am["dst"] == "device"
    g = am.assign(
        to_host=to_host.astype("int64"), bytes_to_host=am["nbytes"].where(to_host, 0),
        to_device=to_device.astype("int64"), bytes_to_device=am["nbytes"].where(to_device, 0),
        prefetched=(am["prefetch"] & to_device).astype("int64"), copy_s=am["duration_s"],
    ).groupby("iteration")[cols[1:]].sum()  # fmt: skip
    return g.reindex(iterations, fill_value=0).rename_axis("iteration").reset_index()


def _activation_lines(profile: Profile, top: int) -> list[str]:
    """The activation moves' section: count, bytes and time each way, their mean per iteration, and
    each iteration while there are at most ``top``."""
    am = profile.activation_moves
    if am.empty:
        return []
    n_blocks = am["block"].nunique()
    lines = ["", f"activation moves (saved activations across the host link, not chunk moves; {n_blocks} block(s))"]
    for dst, label in (("host", "to host"), ("device", "to device")):
        sel = am[am["dst"] == dst]
        prefetched = int(sel["prefetch"].sum())
        extra = f"  ({prefetched} prefetched ahead of the backward)" if prefetched else ""
        lines.append(f"  {label:<24} {len(sel):>8}  {_mib(sel['nbytes'].sum()):>14}  {sel['duration_s'].sum():8.3f} s{extra}")
    table = activation_table(profile)
    per = table[table["iteration"] >= 0]
    for way in ("host", "device") if len(per) else ():
        label = f"to {way} per iteration"
        extra = f"  (mean of {len(per)} iterations)" if way == "host" else ""
        lines.append(f"  {label:<24} {per['to_' + way].mean():>8,.1f}  {_mib(per['bytes_to_' + way].mean()):>14}{extra}")
    if 1 < len(table) <= top:  # each iteration, while they are few enough to read
        for r in table.itertuples(index=False):
            name = f"iteration {r.iteration}" if r.iteration >= 0 else "outside moments"
            lines.append(
                f"    {name:<22} to host {int(r.to_host):>6}  {_mib(r.bytes_to_host):>12},  "
                f"to device {int(r.to_device):>6}  {_mib(r.bytes_to_device):>12}"
            )
    lines.append("  (time: each copy's from its issue to when it was found done, summed; copies overlap, so it is no stall time)")
    return lines


def _ordered(values: Any, known: tuple[str, ...]) -> list[str]:
    seen = {str(v) for v in values}
    return [v for v in known if v in seen] + sorted(seen - set(known))


def _rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 2**20:,.1f} MiB/s" if seconds > 0 else "n/a"


def _disk_lines(profile: Profile) -> list[str]:
    """The disk tier's section: its chunk files, reads and writes with their bandwidth, staging."""
    stats = profile.meta.get("disk_stats")
    stats = stats if isinstance(stats, dict) else {}
    mv = profile.moves
    staged = (mv["src"] == "disk") | (mv["dst"] == "disk")
    if not stats and not staged.any() and not (profile.memory["tier"] == "disk").any():
        return []
    lines = ["", "disk tier (chunk files of the lists on disk, staged through host buffers)"]
    files = stats.get("disk_file_bytes")
    if files is None and (profile.memory["tier"] == "disk").any():
        files = profile.memory.loc[profile.memory["tier"] == "disk", "total_bytes"].max()
    if files is not None:
        lines.append(f"  chunk files          {_mib(files):>14}")
    if stats:
        read, read_s = stats.get("disk_bytes_read", 0), stats.get("disk_read_s", 0.0)
        written, write_s = stats.get("disk_bytes_written", 0), stats.get("disk_write_s", 0.0)
        lines.append(f"  read                 {_mib(read):>14}  in {read_s:8.3f} s of I/O  {_rate(read, read_s):>14}")
        lines.append(f"  written              {_mib(written):>14}  in {write_s:8.3f} s of I/O  {_rate(written, write_s):>14}")
        busy, span = stats.get("disk_busy_s"), stats.get("disk_recorded_s")
        if busy is not None and span:
            lines.append(f"  disk busy            {busy:11.3f} s  of {span:.3f} s recorded ({busy / span:.0%}: a read or a write moving bytes)")
        if "disk_staging_budget_bytes" in stats:
            lines.append(
                f"  staging budget       {_mib(stats['disk_staging_budget_bytes']):>14}  "
                f"peak {_mib(stats.get('disk_staging_peak_bytes', 0))}, "
                f"main thread waited {stats.get('disk_staging_wait_s', 0.0):.3f} s for a buffer"
            )
        lines.append("  (engine stats over the recording; bandwidth: bytes over the time inside reads or writes, all I/O threads)")
    return lines


def summarize(profile: Profile, top: int = 10) -> str:
    m = profile.meta
    lines = [
        f"profile of {m.get('model_name')} ({m.get('n_params', 0):,} params) on {m.get('device')}, "
        f"{m.get('precision')}, {m.get('iterations')} iteration(s)",
        f"budget {_mib(m.get('budget_bytes', 0))}, {m.get('n_chunks')} chunks of {m.get('chunk_size', 0):,} elements, "
        f"model data {_mib(m.get('model_data_bytes', 0))}",
        "",
    ]
    predicted = profile.prediction
    if predicted is not None:
        figures = [f"{predicted['seconds_per_step']:,.3f} s/step"] if "seconds_per_step" in predicted else []
        figures += [f"bound by {predicted['binding']}"] if "binding" in predicted else []
        lines.insert(
            2,
            "PREDICTED, not measured: a dry run's step on the time model's clock" + (f" ({', '.join(figures)})" if figures else ""),
        )
    mv = profile.moves
    way = _directions(mv)
    lines.append("totals")
    for key, label in (("to_device", "moves to device"), ("to_host", "moves to host")):
        sel = mv[way[key]]
        lines.append(f"  {label:<20} {len(sel):>8}  {_mib(sel['nbytes'].sum()):>14}  {sel['duration_s'].sum():8.3f} s")
    for key, label in (("from_disk", "stage-in disk->host"), ("to_disk", "stage-out host->disk")):
        sel = mv[way[key]]
        if len(sel):  # I/O threads do the copies: no time here
            dropped = int((sel["nbytes"] == 0).sum()) if key == "to_disk" else 0
            extra = f"  ({dropped} dropped unchanged, 0 bytes)" if dropped else ""
            lines.append(f"  {label:<20} {len(sel):>8}  {_mib(sel['nbytes'].sum()):>14}{extra}")
    by_reason = mv.groupby("reason")
    for reason in _ordered(mv["reason"], MOVE_REASONS):
        grp = by_reason.get_group(reason)
        lines.append(f"  {reason:<20} {len(grp):>8}  {_mib(grp['nbytes'].sum()):>14}")
    if not profile.stages.empty:
        st = profile.stages.assign(d=profile.stages["t_end_s"] - profile.stages["t_start_s"])
        per = st.groupby("stage")["d"].sum()
        lines.append("  time by stage        " + ", ".join(f"{k} {v:.3f} s" for k, v in per.items()))
    lines.append("")
    lines.append("peak memory per tier")
    mem = profile.memory
    for tier in _ordered(mem["tier"], TIERS):
        grp = mem[mem["tier"] == tier]
        budget = int(grp["budget_bytes"].max())
        lines.append(
            f"  {tier:<8} total {_mib(grp['total_bytes'].max()):>12}  chunks {_mib(grp['chunk_bytes'].max()):>12}  "
            f"non-model {_mib(grp['non_model_bytes'].max()):>12}  budget {_mib(budget) if budget > 0 else 'unbounded':>12}"
        )
    lines += _disk_lines(profile)
    lines += _activation_lines(profile, top)
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
