"""Which modules are the model's blocks: pure, on the module tree.

A block is a repeated layer (``GPT2Block``, ``LlamaDecoderLayer``, ``T5Block``):
the unit whose saved activations are kept, recomputed or offloaded together
(Note [activation policies] in :mod:`chunkstar.activations`). ``"auto"`` takes
the classes a Hugging Face model names in ``_no_split_modules`` (its own list of
the layers that must not be split, which wrapping policies read too) that are
also repeated, the class of every ``nn.ModuleList`` whose two or more children
are all of one class. Blocks inside another block are not blocks: the outermost
ones are.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["find_blocks", "repeated_classes"]


def repeated_classes(model: nn.Module) -> list[str]:
    """Class names of the children of every ``ModuleList`` of two or more modules of one class,
    in the order the lists come."""
    names: dict[str, None] = {}
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            kinds = {type(child) for child in mod}
            if len(kinds) == 1:
                names[next(iter(kinds)).__name__] = None
    return list(names)


def find_blocks(model: nn.Module, names: Sequence[str] | None = None) -> list[nn.Module]:
    """The model's blocks, in module order: the outermost modules whose class is one of
    ``names`` (None: ``"auto"``, the module docstring). A ValueError when none is found,
    naming the repeated classes the model has."""
    wanted: set[str]
    if names is None:
        declared = getattr(model, "_no_split_modules", None)
        declared = set(declared) if isinstance(declared, (list, tuple, set)) else set()
        repeated = set(repeated_classes(model))
        # the declared classes that repeat (some models also declare their embeddings), else either
        wanted = (declared & repeated) or declared or repeated
    else:
        wanted = set(names)
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules within a block found already
    for mod in model.modules():  # parents before children
        if id(mod) in inside or mod is model:
            continue
        if type(mod).__name__ in wanted:
            blocks.append(mod)
            inside.update(id(m) for m in mod.modules())
    if not blocks:
        found = repeated_classes(model)
        if wanted:
            what = f"has no module of the classes {sorted(wanted)}"
            what += f"; its repeated layers are {found}" if found else "; it has no ModuleList of repeated layers either"
        else:  # "auto" found nothing to call a block
            what = "has no repeated layers to take as blocks (no ModuleList of two or more modules of one class)"
        raise ValueError(
            f"activations.blocks: the model ({type(model).__name__}) {what}: name the block classes in "
            "activations.blocks, or leave activations.policy at \"keep\""
        )
    return blocks
