"""Tensor states and chunk locations move only along allowed edges."""

from __future__ import annotations

import pytest
import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.state import ChunkLocation, TensorState, check_tensor_transition
from chunkstar.device.copy_engine import CopyThread, SerialCopies
from chunkstar.errors import ChunkStateError
from chunkstar.events import Tier


def test_gradient_slot_cannot_be_computed_with() -> None:
    with pytest.raises(ChunkStateError, match="optimizer.step"):
        check_tensor_transition("w", TensorState.HOLD_AFTER_BWD, TensorState.COMPUTE)


@pytest.mark.parametrize(
    "old,new",
    [(TensorState.FREE, TensorState.COMPUTE), (TensorState.HOLD, TensorState.HOLD_AFTER_BWD), (TensorState.FREE, TensorState.HOLD_AFTER_FWD)],
)
def test_illegal_edges(old: TensorState, new: TensorState) -> None:
    with pytest.raises(ChunkStateError):
        check_tensor_transition("w", old, new)


def test_training_cycle_is_legal() -> None:
    cycle = [TensorState.FREE, TensorState.HOLD, TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD,
             TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD, TensorState.HOLD, TensorState.COMPUTE]  # fmt: skip
    for a, b in zip(cycle, cycle[1:]):
        check_tensor_transition("w", a, b)


@pytest.mark.parametrize("engine", ["serial", "copy-thread"])
def test_chunk_moves_keep_views_valid_and_free_the_other_tier(engine: str) -> None:
    """Through either CPU copy engine (the copy thread with a delay before every copy,
    so a read that does not wait for its copy would see stale bytes)."""
    copies = SerialCopies() if engine == "serial" else CopyThread(delay=(0.005, 0.01))
    c = Chunk(0, "param", 8, torch.float32, torch.device("cpu"))
    c.allocate(Tier.HOST)
    c.payload.copy_(torch.arange(8.0))
    (view,) = c.device_views([(2, 6, (2, 2))])
    c.move_to(Tier.DEVICE, copies)
    assert c.location is ChunkLocation.DEVICE
    c.wait_ready()  # what make_resident does before a module reads the views
    assert torch.equal(view, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    c.move_to(Tier.HOST, copies)
    memory = c._memory
    # the device bytes stay until the copy has read them and a poll sees it (Note [deferred free])
    assert memory.held_bytes == (0 if engine == "serial" else 32)
    c.payload[2] = 42.0  # payload waits for the eviction's copy to land
    memory.reap()  # the next poll after the copy frees them
    assert c.device_view.untyped_storage().nbytes() == 0 and memory.held_bytes == 0 and memory.pending_bytes == 0
    c.move_to(Tier.DEVICE, copies)
    c.wait_ready()
    assert view[0, 0].item() == 42.0  # the same view sees the data again
    with pytest.raises(ChunkStateError):
        c.move_to(Tier.DEVICE, copies)
    copies.close()


@pytest.mark.parametrize("engine", ["serial", "copy-thread"])
def test_a_clean_chunk_leaves_the_device_without_a_copy_and_a_written_one_with_one(engine: str) -> None:
    """Note [clean host copy]: a chunk brought with ``keep_host`` keeps its host buffer;
    until its payload is touched on the device, evicting it copies nothing."""
    copies = SerialCopies() if engine == "serial" else CopyThread(delay=(0.005, 0.01))
    c = Chunk(0, "param", 8, torch.float32, torch.device("cpu"))
    c.allocate(Tier.HOST)
    c.payload.copy_(torch.arange(8.0))
    assert c.move_to(Tier.DEVICE, copies, keep_host=True)
    c.wait_ready()
    assert c.clean and c.has_host_buffer
    assert not c.move_to(Tier.HOST, copies)  # no bytes copied back
    assert c.device_view.untyped_storage().nbytes() == 0
    assert torch.equal(c.payload, torch.arange(8.0))

    c.move_to(Tier.DEVICE, copies, keep_host=True)
    host = c._host_buf
    c.payload[0] = -1.0  # a write on the device: the host copy is stale now
    assert not c.clean
    assert c.move_to(Tier.HOST, copies)  # copied back, into the buffer it kept
    assert c.payload[0].item() == -1.0 and c._host_buf is host

    c.move_to(Tier.DEVICE, copies)  # without keep_host the host buffer goes
    assert not c.has_host_buffer
    copies.close()
