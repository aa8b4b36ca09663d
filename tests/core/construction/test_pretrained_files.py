"""Hostile and damaged checkpoints given to ``pretrained=`` (Note [reading a checkpoint]).

Every file that is not a well-formed safetensors checkpoint inside its directory is
refused with a :class:`chunkstar.PretrainedError` before a byte of it reaches a chunk:
special files are never opened (a FIFO would block forever), shard paths never leave
the checkpoint directory, headers are held to the rules the ``safetensors`` library
holds them to (each case here is checked against it too), a tensor's dtype must fit the
parameter it fills, and the messages never echo the file's bytes. NaN or infinite
weights load, with a warning naming them.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.construction.pretrained import PretrainedSource
from tests.core._models import engine_config


class _Small(nn.Module):
    """Two float parameters and a BatchNorm (float and int64 buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _values() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {k: v.clone() for k, v in _Small().state_dict().items()}


def _engine(**kw: Any) -> Any:
    torch.manual_seed(0)
    engine, _ = chunkstar.initialize_engine(_Small, 0, engine_config("fp32", budget="64MB", chunk_size="auto"), **kw)
    return engine


def _raw_file(path: Path, header: object, data: bytes = b"", *, raw_header: bytes | None = None) -> Path:
    """A file in safetensors' layout with whatever header (JSON-encoded unless raw) and data."""
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _safetensors_refuses(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:
        return True
    return False


def _within(seconds: float, fifos: list[Path], fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn``; what it raised. Fails the test when it blocks (opening one of ``fifos``
    for reading waits for a writer: the test opens them for writing to release it)."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(seconds)
        pytest.fail(f"pretrained= blocked for {seconds}s on a special file")
    return out[0]


# ------------------------------------------------------------- special files are never opened
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return s


_SPECIAL_PLACES = [
    (kind, place)
    for kind in ("fifo", "directory", "socket")
    for place in ("only-file", "model.safetensors", "index-shard", "given-directly")
    if (kind, place) != ("directory", "given-directly")  # a directory given is a checkpoint directory
]


@pytest.mark.parametrize(("kind", "place"), _SPECIAL_PLACES, ids=[f"{k}-{p}" for k, p in _SPECIAL_PLACES])
def test_a_special_file_in_place_of_a_shard_is_refused_without_opening_it(tmp_path: Path, kind: str, place: str) -> None:
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    name = {"only-file": "weights.safetensors", "model.safetensors": "model.safetensors"}.get(place, "s.safetensors")
    special = ckpt / name
    held = _socket(special) if kind == "socket" else None
    if kind == "fifo":
        _fifo(special)
    elif kind == "directory":
        _directory(special)
    if place == "index-shard":
        _save(ckpt / "a.safetensors", {"fc.weight": torch.zeros(3, 4)})
        weight_map = {"fc.weight": "a.safetensors", "fc.bias": name}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    target = special if place == "given-directly" else ckpt
    try:
        raised = _within(10, [special] if kind == "fifo" else [], lambda: PretrainedSource(target))
    finally:
        if held is not None:
            held.close()
    assert isinstance(raised, chunkstar.PretrainedError), raised
    what = {"fifo": "FIFO", "directory": "directory", "socket": "socket"}[kind]
    assert what in str(raised) and "not a regular file" in str(raised)


def test_a_character_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(chunkstar.PretrainedError, match="character device"):
        PretrainedSource(link)


# ------------------------------------------------------------------- paths stay inside the checkpoint
def _outside_checkpoint(tmp_path: Path) -> Path:
    """A valid checkpoint of the model's tensors outside the directory under test."""
    (tmp_path / "elsewhere").mkdir()
    return _save(tmp_path / "elsewhere" / "secret.safetensors", _values())


@pytest.mark.parametrize("entry", ["relative", "absolute"])
def test_an_index_entry_outside_the_directory_is_refused(tmp_path: Path, entry: str) -> None:
    secret = _outside_checkpoint(tmp_path)
    ckpt = tmp_path / "deep" / "ckpt"
    ckpt.mkdir(parents=True)
    name = "../../elsewhere/secret.safetensors" if entry == "relative" else str(secret)
    weight_map = {k: name for k in _values()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(chunkstar.PretrainedError, match="outside the checkpoint directory"):
        _engine(pretrained=ckpt)


@pytest.mark.parametrize("name", ["model.safetensors", "weights.safetensors", "shard.safetensors", "index"])
def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    secret = _outside_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if name == "index":  # an index elsewhere, naming its own neighbour
        (secret.parent / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {k: "secret.safetensors" for k in _values()}})
        )
        (ckpt / "model.safetensors.index.json").symlink_to(secret.parent / "model.safetensors.index.json")
        (ckpt / "secret.safetensors").write_bytes(b"")
    else:
        (ckpt / name).symlink_to(secret)
    if name == "shard.safetensors":
        weight_map = {k: name for k in _values()}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(chunkstar.PretrainedError, match="outside the checkpoint directory"):
        PretrainedSource(ckpt)


def test_links_inside_the_directory_and_the_hub_cache_layout_load(tmp_path: Path) -> None:
    want = _values()
    inside = tmp_path / "ckpt"
    inside.mkdir()
    _save(inside / "real.safetensors", want)
    (inside / "model.safetensors").symlink_to("real.safetensors")
    # the Hugging Face hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    _save(repo / "blobs" / "0f1e2d", want)
    (repo / "snapshots" / "abc123" / "model.safetensors").symlink_to("../../blobs/0f1e2d")
    for ckpt in (inside, repo / "snapshots" / "abc123"):
        got = _engine(pretrained=ckpt).state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_file_that_is_not_safetensors_is_refused_without_echoing_it(tmp_path: Path) -> None:
    text = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    for head in (text, struct.pack("<Q", 12) + b"daemon:x:1:1" + text):  # a huge header length; a short one
        path = tmp_path / "passwd.safetensors"
        path.write_bytes(head)
        with pytest.raises(chunkstar.PretrainedError, match="not a safetensors file") as err:
            PretrainedSource(path)
        message = str(err.value)
        assert str(int.from_bytes(head[:8], "little")) not in message
        assert "x:0:0" not in message and "daemon" not in message and "bash" not in message


# ------------------------------------------------------------------- headers, as safetensors checks them
def _f32(n: int, begin: int = 0, end: int | None = None) -> dict[str, object]:
    return {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n if end is None else end]}


_TWO = b"\x00" * 8
_BAD_HEADERS: dict[str, tuple[object, bytes]] = {
    "negative-offsets": ({"w": _f32(2, -8, 0)}, b""),
    "reversed-offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, _TWO),
    "overlapping-tensors": ({"a": _f32(2), "b": _f32(2)}, _TWO),
    "gap-between-tensors": ({"a": _f32(1), "b": _f32(1, 8)}, b"\x00" * 12),
    "bytes-after-the-last-tensor": ({"w": _f32(2)}, b"\x00" * 12),
    "data-past-the-end": ({"w": _f32(2)}, b"\x00" * 4),
    "size-is-not-numel-times-itemsize": ({"w": _f32(3, 0, 8)}, _TWO),
    "negative-shape": ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, b""),
    "float-shape": ({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, _TWO),
    "bool-shape": ({"w": {"dtype": "F32", "shape": [True, True], "data_offsets": [0, 4]}}, b"\x00" * 4),
    "shape-not-a-list": ({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, _TWO),
    "string-offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, _TWO),
    "three-offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}}, _TWO),
    "unknown-dtype": ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, _TWO),
    "dtype-not-a-string": ({"w": {"dtype": 5, "shape": [2], "data_offsets": [0, 8]}}, _TWO),
    "no-shape": ({"w": {"dtype": "F32", "data_offsets": [0, 8]}}, _TWO),
    "entry-not-an-object": ({"w": [0, 8]}, _TWO),
    "metadata-not-strings": ({"__metadata__": {"format": 1}, "w": _f32(2)}, _TWO),
    "header-a-list": ([1, 2], b""),
    "header-null": (None, b""),
    "header-a-string": ("w", b""),
    "header-a-number": (5, b""),
}
_BAD_RAW: dict[str, bytes] = {
    "not-utf8": b"\xff\xfe{}",
    "not-json": b"{nope",
    "duplicate-name": b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
}


@pytest.mark.parametrize("case", [*_BAD_HEADERS, *_BAD_RAW])
def test_a_malformed_header_is_refused_as_safetensors_refuses_it(tmp_path: Path, case: str) -> None:
    path = tmp_path / "bad.safetensors"
    if case in _BAD_RAW:
        _raw_file(path, None, _TWO, raw_header=_BAD_RAW[case])
    else:
        _raw_file(path, *_BAD_HEADERS[case])
    assert _safetensors_refuses(path)  # the reference reader agrees the file is bad
    with pytest.raises(chunkstar.PretrainedError) as err:
        PretrainedSource(path)
    message = str(err.value)
    assert "data_offsets'" not in message and "{'" not in message  # no header echoed back
    assert len(message.splitlines()) == 1


def test_header_length_past_the_end_and_a_short_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 4096) + b'{"w":{}}')
    (tmp_path / "short.safetensors").write_bytes(b"\x10\x00")
    for name in ("long", "short"):
        with pytest.raises(chunkstar.PretrainedError, match="not a safetensors file"):
            PretrainedSource(tmp_path / f"{name}.safetensors")


def test_what_safetensors_accepts_is_read(tmp_path: Path) -> None:
    padded = json.dumps({"__metadata__": {"format": "pt"}, "w": _f32(2), "e": _f32(0, 8)}).encode() + b"    "
    extra = {"w": {**_f32(2), "note": "ignored"}, "__metadata__": None}
    data = struct.pack("<2f", 1.5, -2.0)
    for i, (header, raw) in enumerate([(None, padded), (extra, None)]):
        path = _raw_file(tmp_path / f"ok{i}.safetensors", header, data, raw_header=raw)
        assert not _safetensors_refuses(path)
        with PretrainedSource(path) as src:
            assert torch.equal(src.read("w"), torch.tensor([1.5, -2.0]))


# ------------------------------------------------------------------- dtypes and values
def test_integer_bytes_are_not_read_into_a_float_parameter(tmp_path: Path) -> None:
    values = _values()
    values["fc.weight"] = values["fc.weight"].view(torch.int32)  # the float bytes, declared I32
    with pytest.raises(chunkstar.PretrainedError, match=r"'fc\.weight'.*I32"):
        _engine(pretrained=_save(tmp_path / "i32.safetensors", values))
    values = _values()
    values["norm.running_mean"] = values["norm.running_mean"].to(torch.int64)
    with pytest.raises(chunkstar.PretrainedError, match=r"norm\.running_mean"):
        _engine(pretrained=_save(tmp_path / "buffer.safetensors", values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_file_fills_the_fp32_masters(tmp_path: Path, dtype: torch.dtype) -> None:
    values = _values()
    values["norm.num_batches_tracked"] = torch.tensor(7)  # int64, into the int64 buffer
    stored = {k: v.to(dtype) if v.is_floating_point() else v for k, v in values.items()}
    got = _engine(pretrained=_save(tmp_path / "w.safetensors", stored)).state_dict()
    for k, v in stored.items():
        want = v.float() if v.is_floating_point() else v
        assert torch.equal(got[k], want), k


def test_nan_and_inf_weights_load_with_a_warning_naming_them(tmp_path: Path) -> None:
    values = _values()
    values["fc.weight"][1, 2] = float("nan")
    values["norm.weight"][0] = float("-inf")
    with pytest.warns(UserWarning, match=r"NaN or infinite") as caught:
        engine = _engine(pretrained=_save(tmp_path / "nan.safetensors", values))
    message = " ".join(str(w.message) for w in caught)
    assert "fc.weight" in message and "norm.weight" in message and "fc.bias" not in message
    assert sorted(engine.construction.nonfinite) == ["fc.weight", "norm.weight"]
    assert torch.isnan(engine.state_dict()["fc.weight"][1, 2])
    with warnings.catch_warnings(record=True) as clean:
        warnings.simplefilter("always")
        assert not _engine(pretrained=_save(tmp_path / "ok.safetensors", _values())).construction.nonfinite
    assert not [w for w in clean if "NaN" in str(w.message)]


# ------------------------------------------------------------------- malformed arguments and indexes
@pytest.mark.parametrize("path", [5, b"/tmp/model.safetensors", "", 1.5, ["a.safetensors"]], ids=repr)
def test_pretrained_that_is_not_a_path_is_a_typed_error(path: object) -> None:
    with pytest.raises(chunkstar.PretrainedError, match="pretrained= takes") as err:
        _engine(pretrained=path)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize(
    "index",
    [
        {"weight_map": ["a.safetensors"]},
        {"weight_map": 5},
        {"weight_map": None},
        {"weight_map": {}},
        {"weight_map": {"fc.weight": 5}},
        {"metadata": {}},
        ["weight_map"],
        None,
        "weight_map",
    ],
    ids=["list", "int", "null", "empty", "entry-not-a-name", "no-weight-map", "index-a-list", "index-null", "index-a-string"],
)
def test_a_malformed_index_is_a_typed_error(tmp_path: Path, index: object) -> None:
    _save(tmp_path / "a.safetensors", _values())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(chunkstar.PretrainedError, match="model.safetensors.index.json") as err:
        PretrainedSource(tmp_path)
    assert len(str(err.value).splitlines()) == 1


def test_a_bad_pretrained_is_refused_before_the_model_is_built(tmp_path: Path) -> None:
    built: list[bool] = []

    def build() -> torch.nn.Module:
        built.append(True)
        return torch.nn.Linear(4, 4)

    for bad in (5, str(tmp_path / "missing")):
        with pytest.raises(chunkstar.PretrainedError):
            chunkstar.initialize_engine(build, 0, engine_config("fp32", budget="16MB"), pretrained=bad)  # type: ignore[arg-type]
    assert not built, "model_func ran before pretrained= was checked"
