"""The disk tier's chunk files (chunkstar.disk.files, chunkstar.disk.claim).

- chunks round-trip bit for bit, any dtype and size, aligned or not, direct or
  buffered, several lists of their own sizes, only the chunk ids this rank owns;
- the bytes really are in the file, at 4096-aligned offsets the manifest names;
- a previous run's files are refused with a message naming them, their run and
  the fix; ``wipe`` deletes them and nothing else;
- a live process holding a rank lock (a real subprocess) keeps other runs out;
- the free-space check refuses before anything is allocated, and a write that
  hits ENOSPC says where and how much;
- a chunk whose bytes on disk are not those last written (overwritten with
  0xFF, zeroed, truncated and regrown), in any piece of it, is refused when it
  is read, naming the file and the chunk; a write that failed leaves the chunk
  lost until a later write completes (Note [chunk checks]);
- a list in pieces moves a run of pieces alone, each piece checked and marked
  lost on its own (Note [chunk pieces]).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from chunkstar.disk import ALIGNMENT, ChunkFiles, DiskFullError, DiskTierError, FilesState, aligned_empty, is_aligned
from chunkstar.disk.blockio import byte_view

from tests.core._faults import file_size_limit

STATE = ["master", "exp_avg", "exp_avg_sq"]


def _random_bits(nbytes: int, dtype: torch.dtype, seed: int, aligned: bool) -> torch.Tensor:
    """A tensor of ``nbytes`` random bytes viewed as ``dtype`` (NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    t = aligned_empty(nbytes) if aligned else torch.empty(nbytes + 8, dtype=torch.uint8)[8:]
    if not aligned:
        assert not is_aligned(t)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return t.view(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t))


def _create(directory: Path, tag: str = "run-a", rank: int = 0, **kw: object) -> ChunkFiles:
    kw.setdefault("lists", STATE)
    kw.setdefault("chunk_nbytes", {0: 64 << 10, 1: 64 << 10})
    return ChunkFiles.create(directory, run_tag=tag, rank=rank, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_chunks_round_trip_bit_exact(tmp_path: Path, dtype: torch.dtype, aligned: bool, direct: bool) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    # owned subset of chunk ids; sizes: whole blocks, a few elements, odd and above one block
    numels = {3: 4096 * 8 // itemsize, 7: 5, 11: 12345, 20: (1 << 20) // itemsize + 3}
    sizes = {cid: n * itemsize for cid, n in numels.items()}
    with _create(tmp_path, chunk_nbytes=sizes, direct=direct) as files:
        written = {}
        for li, name in enumerate(STATE):
            for cid, nbytes in sizes.items():
                src = _random_bits(nbytes, dtype, seed=100 * li + cid, aligned=aligned)
                files.write_from(name, cid, src)
                written[name, cid] = _bits(src)
        for (name, cid), expected in written.items():
            if aligned:
                dst = aligned_empty(sizes[cid], dtype)
            else:
                dst = torch.zeros(sizes[cid] + 8, dtype=torch.uint8)[8:].view(dtype)
            files.read_into(name, cid, dst)
            assert _bits(dst) == expected, f"{name} chunk {cid} ({dtype}, aligned={aligned}, direct={direct})"
        st = files.stats
        assert st.reads == st.writes == len(written)
        assert st.bytes_read == st.bytes_written == sum(sizes.values()) * len(STATE)
        assert st.read_seconds > 0 and st.write_seconds > 0
        assert st.buffered_fallbacks == (2 * len(written) if direct and not aligned and files.direct else 0)
        if direct:
            assert files.direct == (files.direct_fallback is None)  # on unless the filesystem refused it
        else:
            assert not files.direct and files.direct_fallback == "direct=False"


def test_bytes_are_in_the_file_at_aligned_offsets_the_manifest_names(tmp_path: Path) -> None:
    per_list = {"master": {0: 10_000 * 4, 5: 3 * 4}, "param": {0: 10_000 * 2, 5: 3 * 2, 9: 4096}}
    with ChunkFiles.create(tmp_path, run_tag="t", rank=2, lists=["master", "param"], chunk_nbytes=per_list) as files:
        assert files.chunk_ids("param") == (0, 5, 9) and files.nbytes("param", 0) == 20_000
        srcs = {}
        for name, sizes in per_list.items():
            for cid, nbytes in sizes.items():
                srcs[name, cid] = _random_bits(nbytes, torch.uint8, seed=cid, aligned=True)
                files.write_from(name, cid, srcs[name, cid])
        manifest = json.loads((tmp_path / "chunkstar-r2.manifest.json").read_text())
        assert manifest["format"] == "chunkstar-disk-tier" and manifest["version"] == 1
        assert manifest["run_tag"] == "t" and manifest["rank"] == 2 and manifest["pid"] == os.getpid()
        for name, sizes in per_list.items():
            entry = manifest["lists"][name]
            raw = (tmp_path / entry["file"]).read_bytes()
            assert len(raw) == entry["bytes"] == sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes.values())
            for cid, nbytes in sizes.items():
                slot = entry["chunks"][str(cid)]
                assert slot["offset"] % ALIGNMENT == 0 and slot["nbytes"] == nbytes
                assert raw[slot["offset"] : slot["offset"] + nbytes] == _bits(srcs[name, cid])
        assert files.file_bytes == sum(manifest["lists"][n]["bytes"] for n in per_list)


def test_an_unwritten_chunk_reads_as_zeros_and_wrong_buffers_are_refused(tmp_path: Path) -> None:
    with _create(tmp_path) as files:
        dst = torch.full((16 << 10,), 7.0)
        files.read_into("exp_avg", 1, dst)
        assert torch.count_nonzero(dst) == 0
        with pytest.raises(ValueError, match="exactly that"):
            files.read_into("exp_avg", 1, torch.empty(16 << 10 + 1))
        with pytest.raises(ValueError, match="exactly that"):
            files.write_from("exp_avg", 1, torch.empty(2, 8 << 10))
        with pytest.raises(ValueError, match=r"chunk 4 of list 'master' is not stored by rank 0 \(its chunks: 0, 1\)"):
            files.read_into("master", 4, dst)
        with pytest.raises(ValueError, match="lists on disk are"):
            files.read_into("param", 0, dst)


def test_close_keeps_the_files_remove_deletes_everything(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    files = _create(tmp_path)
    assert files.state is FilesState.OPEN
    files.remove()
    assert files.state is FilesState.REMOVED
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
    files.remove()  # idempotent
    with pytest.raises(DiskTierError, match="removed"):
        files.read_into("master", 0, torch.empty(16 << 10))

    files = _create(tmp_path)
    files.close()
    assert files.state is FilesState.CLOSED
    assert "chunkstar-r0-master.chunks" in os.listdir(tmp_path)
    with pytest.raises(DiskTierError, match=r"remove\(\) after close\(\)"):
        files.remove()


def test_a_previous_runs_files_are_refused_then_wiped_sparing_other_files(tmp_path: Path) -> None:
    for rank in (0, 1):  # a two-rank run that ended without remove()
        old = _create(tmp_path, tag="old-run", rank=rank)
        old.write_from("master", 0, torch.ones(16 << 10))
        old.close()
    unrelated = ["notes.txt", "chunkstar-notes.txt", "chunkstar-r0-master.chunks.bak"]
    for name in unrelated:
        (tmp_path / name).write_text("not chunkstar's")

    with pytest.raises(DiskTierError) as info:
        _create(tmp_path, tag="new-run", rank=0)
    msg = str(info.value)
    for part in (
        str(tmp_path),
        "chunkstar-r0-master.chunks",
        "chunkstar-r1-exp_avg_sq.chunks",
        "chunkstar-r1.manifest.json",
        "'old-run'",
        f"pid {os.getpid()}",
        "'new-run'",
        '"disk": {"on_stale": "wipe"}',
        "delete them yourself",
    ):
        assert part in msg, f"{part!r} missing from: {msg}"
    assert (tmp_path / "chunkstar-r1-master.chunks").exists(), "refuse must not delete anything"

    with _create(tmp_path, tag="new-run", rank=0, on_stale="wipe") as files:
        left = sorted(os.listdir(tmp_path))
        assert not any(n.startswith("chunkstar-r1") for n in left), left
        dst = torch.full((16 << 10,), 3.0)
        files.read_into("master", 0, dst)
        assert torch.count_nonzero(dst) == 0, "a wiped run's bytes must not show through"
        assert json.loads((tmp_path / "chunkstar-r0.manifest.json").read_text())["run_tag"] == "new-run"
    assert sorted(os.listdir(tmp_path)) == sorted(unrelated)


def test_ranks_of_one_run_share_a_directory(tmp_path: Path) -> None:
    r0 = _create(tmp_path, tag="same", rank=0)
    r1 = _create(tmp_path, tag="same", rank=1)
    r1.close()  # a sibling that has finished: its files are this run's, not stale
    r2 = _create(tmp_path, tag="same", rank=2)
    with pytest.raises(DiskTierError, match=f"held by another engine of this very process .*pid {os.getpid()}.*call close"):
        _create(tmp_path, tag="same", rank=0)  # the same rank twice, in one process: the message says so
    with pytest.raises(DiskTierError, match="two live runs"):
        _create(tmp_path, tag="other", rank=3)  # another run while this one is live
    assert (tmp_path / "chunkstar-r1-master.chunks").exists()
    r0.remove()
    r2.remove()


_HOLDER = textwrap.dedent(
    """
    import os, sys
    from chunkstar.disk import ChunkFiles
    files = ChunkFiles.create(sys.argv[1], run_tag="holder-run", rank=0, lists=["master"], chunk_nbytes={0: 4096})
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(0)  # a crash: no close, no remove
    """
)


def test_a_live_process_holding_the_lock_keeps_other_runs_out(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        for rank, wipe in ((0, "wipe"), (1, "wipe"), (0, "refuse")):
            with pytest.raises(DiskTierError) as info:
                _create(tmp_path, tag="intruder", rank=rank, on_stale=wipe)
            msg = str(info.value)
            assert "locked by another live process" in msg and f"pid {proc.pid}" in msg and "'holder-run'" in msg, msg
            assert "two live runs" in msg
        assert (tmp_path / "chunkstar-r0-master.chunks").exists(), "a live run's files must never be wiped"
        with _create(tmp_path, tag="holder-run", rank=1):  # a sibling rank of the live run is welcome
            pass
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    # the holder died: its lock went with it, its files are now stale
    with pytest.raises(DiskTierError, match=rf"'holder-run' \(pid {proc.pid} on host"):
        _create(tmp_path, tag="intruder")
    with _create(tmp_path, tag="intruder", on_stale="wipe"):
        pass
    assert os.listdir(tmp_path) == []


def test_not_enough_free_space_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    ask = free + (1 << 30)
    with pytest.raises(DiskFullError) as info:
        _create(tmp_path, lists=["master"], chunk_nbytes={0: ask})
    e = info.value
    assert e.path == tmp_path and e.needed >= ask and 0 < e.free <= free + (64 << 20)
    assert str(tmp_path) in str(e) and f"({e.needed} bytes) needed" in str(e) and f"({e.free} bytes) free" in str(e)
    assert isinstance(e, DiskTierError) and isinstance(e, RuntimeError)
    assert os.listdir(tmp_path) == [], "nothing may be left behind"


def test_a_write_that_hits_enospc_raises_disk_full_with_path_and_bytes(tmp_path: Path) -> None:
    with _create(tmp_path, direct=False) as files:
        # the one artificial part: the list's descriptor becomes /dev/full, whose writes fail ENOSPC
        f = files._files["exp_avg"]
        good = f.fd
        f.fd = os.open("/dev/full", os.O_WRONLY)
        try:
            with pytest.raises(DiskFullError) as info:
                files.write_from("exp_avg", 1, torch.ones(16 << 10))
        finally:
            os.close(f.fd)
            f.fd = good
        msg = str(info.value)
        assert str(files.path("exp_avg")) in msg and "65536 bytes" in msg and "chunk 1 of list 'exp_avg'" in msg


def _resident_bytes(path: Path) -> int:
    cmd = ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs fincore (util-linux) to see the page cache")
@pytest.mark.parametrize("direct", [True, False])
def test_the_page_cache_keeps_no_second_copy(tmp_path: Path, direct: bool) -> None:
    n = 4 << 20
    with _create(tmp_path, lists=["master"], chunk_nbytes={c: n for c in range(4)}, direct=direct) as files:
        buf = _random_bits(n, torch.uint8, seed=0, aligned=True)
        for c in range(4):
            files.write_from("master", c, buf)
        after_writes = _resident_bytes(files.path("master"))
        for c in range(4):
            files.read_into("master", c, buf)
        after_reads = _resident_bytes(files.path("master"))
    # a little slack: the kernel may keep a page or two it is still looking at
    assert after_writes <= 64 << 10 and after_reads <= 64 << 10, (after_writes, after_reads)


BIG = (9 << 20) + 12344
"""A chunk read in three pieces (of 4 MiB: Note [chunk checks]), each summed while the next is
read, the last one not a whole block."""


def _corrupt(path: Path, how: str, offset: int, nbytes: int) -> None:
    """Change the bytes of one slot behind the files' back."""
    if how == "0xff":  # a stray write into the middle of the slot
        with open(path, "r+b") as f:
            f.seek(offset + nbytes // 2)
            f.write(b"\xff" * 64)
    elif how == "zeros":
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(nbytes))
    else:  # truncated, then regrown by a later write past the end: the slot reads zeros
        size = path.stat().st_size
        os.truncate(path, 0)
        os.truncate(path, size)


@pytest.mark.parametrize("how", ["0xff", "zeros", "truncated"])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("nbytes", [64 << 10, BIG], ids=["one-piece", "three-pieces"])
def test_a_chunk_changed_on_disk_is_refused_naming_the_file_and_chunk(
    tmp_path: Path, how: str, direct: bool, nbytes: int
) -> None:
    with _create(tmp_path, lists=["master", "exp_avg"], chunk_nbytes={0: nbytes, 1: nbytes}, direct=direct) as files:
        srcs = {cid: _random_bits(nbytes, torch.float32, seed=cid, aligned=True) for cid in (0, 1)}
        for cid, src in srcs.items():
            files.write_from("exp_avg", cid, src)
        dst = aligned_empty(nbytes, torch.float32)
        files.read_into("exp_avg", 1, dst)  # the check passes on what was written
        assert _bits(dst) == _bits(srcs[1])
        manifest = json.loads((tmp_path / "chunkstar-r0.manifest.json").read_text())
        offset = manifest["lists"]["exp_avg"]["chunks"]["1"]["offset"]
        _corrupt(files.path("exp_avg"), how, offset, nbytes)
        with pytest.raises(DiskTierError, match=r"chunk 1 of list 'exp_avg' .*chunkstar-r0-exp_avg\.chunks.*not the ones") as info:
            files.read_into("exp_avg", 1, dst)
        assert "restart from a checkpoint" in str(info.value)
        if how != "truncated":  # the other chunk is intact
            files.read_into("exp_avg", 0, dst)
            assert _bits(dst) == _bits(srcs[0])
        files.read_into("master", 1, dst)  # never written: zeros, and zeros pass
        assert torch.count_nonzero(dst) == 0


@pytest.mark.parametrize("direct", [True, False])
def test_a_write_that_failed_leaves_the_chunk_lost_until_a_write_completes(tmp_path: Path, direct: bool) -> None:
    n = 64 << 10
    with _create(tmp_path, lists=["master"], chunk_nbytes={0: n, 1: n}, direct=direct) as files:
        old, new = (_random_bits(n, torch.uint8, seed=s, aligned=True) for s in (1, 2))
        files.write_from("master", 1, old)
        with file_size_limit(n + 4096), pytest.raises(DiskTierError, match="chunk 1 of list 'master'"):
            files.write_from("master", 1, new)  # slot 1 is [n, 2n): some bytes of it are written, then EFBIG
        dst = aligned_empty(n)
        # whatever the file holds now (the old bytes, or some of the new), it is not the chunk
        with pytest.raises(DiskTierError, match=r"chunk 1 of list 'master' .* is lost: its last write failed"):
            files.read_into("master", 1, dst)
        files.mark_lost("master", 0, "its write-behind was not done")
        with pytest.raises(DiskTierError, match="chunk 0 of list 'master' .* is lost: its write-behind was not done"):
            files.read_into("master", 0, dst)
        files.write_from("master", 1, new)  # a write that completes supersedes the failed one
        files.read_into("master", 1, dst)
        assert _bits(dst) == _bits(new)


def test_a_flipped_bit_or_two_swapped_blocks_are_seen(tmp_path: Path) -> None:
    """What the checksum must catch beyond whole regions (Note [chunk checksum]): one bit
    anywhere, the top bit of a word, blocks in the wrong order."""
    n = (3 << 20) + 1000  # whole blocks and a tail
    with _create(tmp_path, lists=["master"], chunk_nbytes={0: n}) as files:
        src = _random_bits(n, torch.uint8, seed=7, aligned=True)
        path, dst = files.path("master"), aligned_empty(n)
        raw = path.read_bytes()[:n]
        for byte, bit in [(0, 0), (4096 * 300 + 7, 7), (n - 1, 3), (8 * 1000 + 7, 7)]:  # (8k+7, 7): a word's top bit
            files.write_from("master", 0, src)
            with open(path, "r+b") as f:
                f.seek(byte)
                f.write(bytes([raw[byte] ^ (1 << bit)]))
            with pytest.raises(DiskTierError, match="not the ones written"):
                files.read_into("master", 0, dst)
        files.write_from("master", 0, src)
        with open(path, "r+b") as f:  # blocks 5 and 9 swapped
            f.seek(5 * 4096)
            f.write(raw[9 * 4096 : 10 * 4096])
            f.seek(9 * 4096)
            f.write(raw[5 * 4096 : 6 * 4096])
        with pytest.raises(DiskTierError, match="not the ones written"):
            files.read_into("master", 0, dst)
        files.write_from("master", 0, src)
        files.read_into("master", 0, dst)
        assert _bits(dst) == _bits(src)


@pytest.mark.parametrize("direct", [True, False])
def test_pieces_of_a_chunk_move_and_are_checked_on_their_own(tmp_path: Path, direct: bool) -> None:
    """Note [chunk pieces]: a list's chunks in pieces of 16 KiB (the last one shorter); a run
    of pieces moves alone, bit for bit, and each piece has its own checksum and lost mark."""
    piece, n = 16 << 10, 3 * (16 << 10) + 848
    with _create(tmp_path, lists=["master", "param"], chunk_nbytes={0: n, 1: n}, piece_nbytes={"master": piece},
                 direct=direct) as files:  # fmt: skip
        assert files.piece_nbytes("master") == piece and files.piece_nbytes("param") == 0
        assert files.nbytes("master", 0, range(1, 3)) == 2 * piece and files.nbytes("master", 0, range(3, 4)) == 848
        src = _random_bits(n, torch.uint8, seed=3, aligned=True)
        files.write_from("master", 0, src)
        mid = aligned_empty(2 * piece)
        files.read_into("master", 0, mid, range(1, 3))
        assert _bits(mid) == _bits(src)[piece : 3 * piece]
        tail = _random_bits(848, torch.uint8, seed=4, aligned=True)
        files.write_from("master", 0, tail, range(3, 4))  # the last piece alone
        whole = aligned_empty(n)
        files.read_into("master", 0, whole)
        assert _bits(whole) == _bits(src)[: 3 * piece] + _bits(tail)
        # a piece changed on disk fails the reads that cover it, naming it, and only those
        offset = json.loads((tmp_path / "chunkstar-r0.manifest.json").read_text())["lists"]["master"]["chunks"]["0"]["offset"]
        _corrupt(files.path("master"), "0xff", offset + 2 * piece, piece)
        files.read_into("master", 0, mid, range(0, 2))
        with pytest.raises(DiskTierError, match=r"chunk 0 of list 'master' .*piece 2.*not the ones written"):
            files.read_into("master", 0, mid, range(1, 3))
        with pytest.raises(DiskTierError, match="piece 2"):
            files.read_into("master", 0, whole)
        files.mark_lost("master", 0, "its write-behind was not done", range(1, 2))
        with pytest.raises(DiskTierError, match="is lost: its write-behind was not done"):
            files.read_into("master", 0, mid, range(0, 2))
        one = aligned_empty(piece)
        files.read_into("master", 0, one, range(0, 1))  # piece 0 is neither lost nor changed
        assert _bits(one) == _bits(src)[:piece]
        with pytest.raises(ValueError, match="a run of the chunk's pieces"):
            files.read_into("master", 0, one, range(4, 5))
    with pytest.raises(ValueError, match="multiple of 4096"):
        _create(tmp_path / "bad", piece_nbytes={"master": 1000})
