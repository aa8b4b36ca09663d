"""The benchmark model zoo: GPT configurations by name, and how to build one.

Three families live here:

* the PatrickStar paper's GPT models (``data/paper_models.csv``, copied from the
  project's reference data so the package needs nothing outside itself at run
  time), FFN = 4 x hidden, GPT-2 vocabulary, sequence 1024;
* ``cpu-*`` models sized for a 2-core CPU machine: a ladder from ~7M to ~1.5B
  parameters at sequence 128, dense enough between 100M and 800M that a
  max-scale search under a host-memory cap of a few GiB separates a system
  needing ~14 bytes per parameter (chunkstar) from one needing ~18+ (DeepSpeed
  ZeRO-3 offload);
* the models of the comparison tables (``chunkstar-bench step-time``,
  ``overlap`` and ``activations``, :mod:`chunkstar_bench.comparisons`): ``gpt2-51m`` (``cpu-base``
  with GPT-2's 1024 positions), ``gpt2-30m-v8k`` (the same blocks, an 8192-token
  vocabulary, 256 positions) and ``gpt2-49m-v8k`` (hidden 768, 6 layers, the same
  vocabulary, 128 positions: the step-time table's overhead case) and
  ``gpt2-30m-v8k-1k`` (``gpt2-30m-v8k`` with 1024 positions: the activations table,
  whose sequence search goes to 4x its batch's 256). They are not on the CPU ladder.

Every model is a Hugging Face ``GPT2LMHeadModel`` built from its config (no
downloads), with dropout off and no KV cache. This module imports torch and
transformers lazily, so the parent process of a benchmark (which only reads
names and parameter counts) stays light.

It is not the runner and knows nothing about systems or devices.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

__all__ = ["GPT2_VOCAB", "ModelSpec", "ZOO", "build_hf", "cpu_ladder", "get", "n_params", "paper_label"]

GPT2_VOCAB = 50257
"""GPT-2's BPE vocabulary size, the vocabulary of every zoo model."""


@dataclass(frozen=True)
class ModelSpec:
    """One GPT configuration: enough to build it and to count its parameters and FLOPs."""

    name: str
    """Zoo key, e.g. ``GPT2_1B`` or ``cpu-small``."""
    hidden: int
    """Model width ``h`` (FFN width is 4h)."""
    layers: int
    """Transformer blocks ``L``."""
    heads: int
    """Attention heads (must divide ``hidden``)."""
    seq_len: int = 1024
    """Default tokens per sequence; also the model's position-embedding length."""
    vocab: int = GPT2_VOCAB
    """Vocabulary size ``V`` (input embedding tied to the LM head)."""
    note: str = ""
    """Where the config comes from (the paper's figure label, or why this CPU size)."""


def n_params(spec: ModelSpec) -> int:
    """Exact parameter count of ``build_hf(spec)`` (tied embeddings counted once).

    Token embedding ``V*h`` + position embedding ``seq_len*h`` + per block
    ``12h^2 + 13h`` (qkv ``3h^2+3h``, attention out ``h^2+h``, MLP ``8h^2+5h``,
    two LayerNorms ``4h``) + the final LayerNorm ``2h``.
    """
    h = spec.hidden
    return spec.vocab * h + spec.seq_len * h + spec.layers * (12 * h * h + 13 * h) + 2 * h


def build_hf(spec: ModelSpec) -> GPT2LMHeadModel:
    """A freshly initialised (fp32, on the current default device) GPT-2 for ``spec``.

    Dropout is off (benchmarks compare systems on identical arithmetic) and the
    KV cache is off (training only).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=spec.vocab,
        n_positions=spec.seq_len,
        n_embd=spec.hidden,
        n_layer=spec.layers,
        n_head=spec.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=True,
    )
    # Named explicitly so transformers does not warn about an unset loss type.
    config.loss_type = "ForCausalLM"
    return GPT2LMHeadModel(config)


def paper_label(spec: ModelSpec) -> str | None:
    """The size label the paper's figures use (``'1B'`` ...), from the note; None for the other families."""
    if spec != _PAPER_MODELS.get(spec.name):
        return None
    match = re.search(r"'([^']+)'", spec.note)
    if match:
        return match.group(1)
    if spec.name.startswith("GPT_175B"):
        return "175B"
    return None


def _read_paper_models() -> dict[str, ModelSpec]:
    text = resources.files("chunkstar_bench.data").joinpath("paper_models.csv").read_text()
    specs: dict[str, ModelSpec] = {}
    for row in csv.DictReader(io.StringIO(text)):
        spec = ModelSpec(
            name=row["name"],
            hidden=int(row["hidden"]),
            layers=int(row["layers"]),
            heads=int(row["heads"]),
            seq_len=int(row["seq_len"]),
            note=row.get("note", ""),
        )
        specs[spec.name] = spec
    return specs


# (name, hidden, layers, heads, note). Sequence 128 for all: activations stay
# small beside the model data, so host memory is dominated by what each system
# keeps per parameter, which is what the max-scale search is about.
_CPU_LADDER: tuple[tuple[str, int, int, int, str], ...] = (
    ("cpu-tiny", 128, 2, 4, "fast tests: seconds per step"),
    ("cpu-small", 256, 4, 4, "cpu suite"),
    ("cpu-base", 512, 8, 8, "cpu suite; gpt2-51m at 128 positions"),
    ("cpu-124m", 768, 12, 12, "GPT-2 small shape"),
    ("cpu-200m", 1024, 12, 16, ""),
    ("cpu-250m", 1024, 16, 16, ""),
    ("cpu-300m", 1024, 20, 16, ""),
    ("cpu-355m", 1024, 24, 16, "GPT-2 medium shape"),
    ("cpu-430m", 1024, 30, 16, ""),
    ("cpu-500m", 1280, 22, 20, ""),
    ("cpu-600m", 1280, 27, 20, ""),
    ("cpu-774m", 1280, 36, 20, "GPT-2 large shape"),
    ("cpu-1b", 1536, 34, 16, ""),
    ("cpu-1.5b", 1600, 48, 25, "GPT-2 XL shape"),
    ("cpu-2b", 2048, 38, 16, "beyond host memory: the disk tier's target"),
    ("cpu-3b", 2560, 38, 20, "fp32 weights (12 GB) alone exceed an 8 GiB cap"),
    ("cpu-4b", 2560, 50, 20, "bf16 param chunks (8.1 GB) alone exceed an 8 GiB cap: the param list on disk"),
    ("cpu-5b", 3072, 44, 24, "the param list on disk, 72 GB of chunk files"),
)
_CPU_SEQ = 128


def _cpu_models() -> dict[str, ModelSpec]:
    return {
        name: ModelSpec(name=name, hidden=h, layers=layers, heads=heads, seq_len=_CPU_SEQ, note=note)
        for name, h, layers, heads, note in _CPU_LADDER
    }


_TABLE_MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("gpt2-51m", hidden=512, layers=8, heads=8, seq_len=1024, note="the model of the step-time table (51.5M)"),
    ModelSpec(
        "gpt2-30m-v8k", hidden=512, layers=8, heads=8, seq_len=256, vocab=8192,
        note="the model of the overlap table (29.5M): a small vocabulary, so the chunks of the blocks dominate the moves",
    ),
    ModelSpec(
        "gpt2-49m-v8k", hidden=768, layers=6, heads=12, seq_len=128, vocab=8192,
        note="the step-time table's overhead case (48.9M): batch 4 x 128, everything resident, no clipping",
    ),
    ModelSpec(
        "gpt2-30m-v8k-1k", hidden=512, layers=8, heads=8, seq_len=1024, vocab=8192,
        note="the model of the activations table (29.9M): gpt2-30m-v8k with 1024 positions, for its sequence search",
    ),
)  # fmt: skip

_PAPER_MODELS = _read_paper_models()
ZOO: dict[str, ModelSpec] = {**_PAPER_MODELS, **_cpu_models(), **{m.name: m for m in _TABLE_MODELS}}
"""Every model by name: the paper's GPT configs, the CPU ladder (smallest first), the comparison tables' models."""


def cpu_ladder() -> list[str]:
    """The CPU models' names, smallest first (the max-scale search's default ladder)."""
    return sorted((n for n in ZOO if n.startswith("cpu-")), key=lambda n: n_params(ZOO[n]))


def get(name: str) -> ModelSpec:
    """The zoo entry ``name``; a KeyError naming every known model otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; the zoo has: {', '.join(ZOO)}") from None
