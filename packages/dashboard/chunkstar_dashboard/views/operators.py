"""Chunk movements attributed to the module (operator) whose moment caused them; activation moves per block, apart."""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import charts, loading
from chunkstar_dashboard.data import (
    MOVE_REASONS,
    STAGES,
    MoveFilter,
    activation_moves_by_block,
    activation_totals,
    filter_moves,
    format_bytes,
    format_duration,
    has_activation_moves,
    has_disk_tier,
    move_totals,
    moves_by_operator,
)

MIB = 2**20

st.title("Operator movements")
p = loading.current_profile()
moves = p.moves


def _activation_section() -> None:
    """The activation moves, per block: a kind of move of their own, never in the chunk moves' figures above."""
    act = activation_totals(p.activation_moves)
    st.subheader("Activation moves by block")
    a = st.columns(4)
    a[0].metric("Activation moves", f"{act['moves']:,}")
    a[1].metric("Activations to host", format_bytes(act["bytes_to_host"]),
                help=f"{act['to_host']:,} copies of saved activations, in the forward")  # fmt: skip
    a[2].metric("Activations to device", format_bytes(act["bytes_to_device"]),
                help=f"{act['to_device']:,} copies back for the backward, {act['prefetched']:,} of them prefetched")  # fmt: skip
    a[3].metric("Prefetched", f"{act['prefetched']:,}", help="Copies back to the device issued ahead of the block's backward.")
    table = activation_moves_by_block(p.activation_moves)
    names = {
        "to_host": "copies to host", "to_device": "copies to device", "bytes_to_host": "MiB to host",
        "bytes_to_device": "MiB to device", "copy_s": "issue to done (ms)",
    }  # fmt: skip
    shown = table.assign(bytes_to_host=table["bytes_to_host"] / MIB, bytes_to_device=table["bytes_to_device"] / MIB,
                         copy_s=table["copy_s"] * 1e3).rename(columns=names)  # fmt: skip
    st.dataframe(
        shown, hide_index=True, key="ops_activation_table",
        column_config={
            "MiB to host": st.column_config.NumberColumn(format="%.2f"), "MiB to device": st.column_config.NumberColumn(format="%.2f"),
            "issue to done (ms)": st.column_config.NumberColumn(format="%.3f"),
        },
    )  # fmt: skip
    st.caption(
        "A block's saved activations copied to the host in its forward and back to the device for its backward "
        "(the activation offload policy), over the whole recording: the filters above are the chunk moves'. "
        "Prefetched: copies back issued ahead of the block's backward. Issue to done: each copy's time from its issue "
        "to when it was found done, summed; copies overlap one another and the compute, so it is no stall time."
    )


if moves.empty:
    st.info("This profile recorded no chunk movements (everything fit on the device).")
    if has_activation_moves(p):
        _activation_section()
    st.stop()


def _options(column: str, preferred: tuple[str, ...]) -> list[str]:
    seen = set(moves[column])
    return [v for v in preferred if v in seen] + sorted(seen - set(preferred))


c1, c2, c3, c4 = st.columns(4)
stages = c1.multiselect("Stage", _options("stage", STAGES), default=_options("stage", STAGES), key="ops_stages")
reasons = c2.multiselect("Reason", _options("reason", MOVE_REASONS), default=_options("reason", MOVE_REASONS), key="ops_reasons")
lists = c3.multiselect("Chunk list", _options("chunk_list", tuple(p.meta.get("chunk_lists") or ())), key="ops_lists",
                       default=_options("chunk_list", tuple(p.meta.get("chunk_lists") or ())))  # fmt: skip
lo, hi = int(moves["iteration"].min()), int(moves["iteration"].max())
iterations = c4.slider("Iterations", lo, hi, (lo, hi), key="ops_iters") if hi > lo else (lo, hi)

selected = filter_moves(moves, MoveFilter(tuple(stages), tuple(reasons), tuple(lists), (int(iterations[0]), int(iterations[1]))))
totals = move_totals(selected)
disk = has_disk_tier(p)
m = st.columns(5)
m[0].metric("Moves", f"{totals['moves']:,}")
m[1].metric("To device", format_bytes(totals["bytes_to_device"]), help=f"{totals['to_device']:,} moves")
m[2].metric("To host", format_bytes(totals["bytes_to_host"]), help=f"{totals['to_host']:,} moves from the device")
m[3].metric("Move time", format_duration(totals["stall_s"]),
            help="Sum of the moves' durations: time spent copying chunks (a stall unless the copy overlapped compute)."
            + (" Predicted: the time model's durations, not measured." if p.prediction is not None else ""))  # fmt: skip
m[4].metric("Operators", f"{selected['module'].nunique():,}")
if disk:  # a second row: seven metrics in one would truncate the figures
    d = st.columns(5)
    d[0].metric("Staged in", format_bytes(totals["bytes_from_disk"]), help=f"{totals['from_disk']:,} stage-ins, disk -> host")
    d[1].metric("Staged out", format_bytes(totals["bytes_to_disk"]),
                help=f"{totals['to_disk']:,} stage-outs, host -> disk (0 bytes: dropped unchanged)")  # fmt: skip

table = moves_by_operator(selected)
names = {
    "to_device": "moves to device", "to_host": "moves to host", "from_disk": "stage-ins", "to_disk": "stage-outs",
    "bytes_to_device": "MiB to device", "bytes_to_host": "MiB to host", "bytes_from_disk": "MiB staged in",
    "bytes_to_disk": "MiB staged out", "stall_s": "move time (ms)",
}  # fmt: skip
shown = table.assign(**{c: table[c] / MIB for c in names if c.startswith("bytes_")}, stall_s=table["stall_s"] * 1e3)
if not disk:  # a run without the disk tier: no empty disk columns
    shown = shown.drop(columns=["from_disk", "to_disk", "bytes_from_disk", "bytes_to_disk"])
shown = shown.rename(columns=names)
st.dataframe(
    shown, hide_index=True, key="ops_table",
    column_config={
        **{names[c]: st.column_config.NumberColumn(format="%.2f") for c in names if c.startswith("bytes_") and names[c] in shown},
        "move time (ms)": st.column_config.NumberColumn(format="%.3f"),
    },
)  # fmt: skip
st.caption(
    f"{len(selected):,} of {len(moves):,} moves after the filters. Reason columns count moves; "
    "moves outside any module's moment are listed as (outside moments)."
    + (" Stage-ins and stage-outs are the disk tier's: their I/O runs on I/O threads, so they take no move time here."
       if disk else "")  # fmt: skip
)
if not table.empty:
    st.subheader("Bytes moved by operator (top 20)")
    st.plotly_chart(charts.operator_bytes(table), key="ops_bytes")
if has_activation_moves(p):
    _activation_section()
