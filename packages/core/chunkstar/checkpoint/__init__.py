"""Per-rank checkpoints: save, load (exact resume), and merge into one state dict.

``engine.save_checkpoint(dir)`` has every rank write the chunks it owns (fp32
master, exp_avg, exp_avg_sq; a frozen chunk's param chunk) to
``rank{r}-of-{W}.safetensors`` in a step directory of this save,
``dir/step-<N>-<token>/``, with, as safetensors metadata, the layout (which
parameter sits in which chunk at which offset), the optimizer's scalar state
(its kind, per-parameter step counts, parameter group settings such as lr,
skipped steps), the loss scaler's state, the model's buffers, and the shard's
identity (Note [shard identity]). Once every rank has written, rank 0 publishes
the save by pointing ``dir/latest`` at it and removes the one it replaces, so a
save killed at any point leaves the previous one whole (Note [multi-rank
checkpoints] in :mod:`.directory`). Nothing is gathered: saving costs three small
all-gathers and no rank holds more than its share.

``engine.load_checkpoint(dir)`` reads this rank's shard of the published save
back into the chunks (wherever they are, host or device), refreshes the param
chunks from the masters, and restores the optimizer and the scaler, so training
continues bit for bit as if it had never stopped. It needs an engine of the same
layout, optimizer and world size; for anything else, ``chunkstar merge-checkpoint
DIR OUT.safetensors`` (or :func:`merge_checkpoint`) reassembles every parameter
from its owner's master chunk into a plain state dict keyed by the model's
parameter names (tied parameters once, under their first name, as Hugging Face
does), which ``model.load_state_dict`` of the plain model or
``engine.load_state_dict`` of an engine of any world size loads (weights only;
Adam starts afresh). A directory without ``latest`` is read flat (shards
directly in it, as earlier versions wrote them).

A save may carry a training loop's own state (``client_state``, rank 0's):
written into the same step directory and published with the shards, so it
never pairs with another save's weights; :func:`read_client_state` reads it
back (Note [client state] in :mod:`.resume`).

Every tensor of a shard carries its crc32, checked before a load changes
anything and as a merge reads it (Note [shard checksums]). A save refuses while
gradients wait for a step (Note [saving between steps]); a load, like an
optimizer step, is all or nothing (Note [all or nothing]).

The parts: :mod:`.shard` (one rank's file: name, metadata, checked reading,
Note [shard metadata], Note [shard checksums]), :mod:`.directory` (atomic files
and the publication of a save, Note [atomic files]), :mod:`.resume` (save and
load of an engine) and :mod:`.merge`; what an interrupted step or load leaves is
:mod:`chunkstar.interrupts` (the optimizer's step holds interrupts off too). Data files are safetensors, never pickle.
"""

from __future__ import annotations

from chunkstar.checkpoint.merge import main_merge, merge_checkpoint
from chunkstar.checkpoint.resume import (
    CLIENT_STATE, Checkpointable, load_checkpoint, pending_gradients, read_client_state, save_checkpoint,
)
from chunkstar.checkpoint.shard import CheckpointError, shard_name

__all__ = [
    "CLIENT_STATE", "CheckpointError", "Checkpointable", "load_checkpoint", "main_merge", "merge_checkpoint",
    "pending_gradients", "read_client_state", "save_checkpoint", "shard_name",
]  # fmt: skip
