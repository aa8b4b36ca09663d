"""The main job: train a Hugging Face GPT-2 with chunkstar under a device budget
smaller than the model's parameter bytes.

The model is built from a config (no download). The data is a synthetic but
learnable token stream (a fixed random Markov chain), so the loss visibly
falls. On a machine without a GPU the device is chunkstar's CPU virtual device:
the budget is enforced exactly as it would be on a GPU, and every chunk move is
a real copy.

    python examples/train_gpt2.py --steps 50

Fine-tuning from a saved model: the first run saves the trained model as a
Hugging Face checkpoint (safetensors, fp32, loadable with
``GPT2LMHeadModel.from_pretrained``); the second builds the model on the meta
device and streams the checkpoint straight into the chunks, so its held-out
loss before training is the first run's held-out loss after it.

    python examples/train_gpt2.py --steps 50 --save-pretrained runs/gpt2-demo
    python examples/train_gpt2.py --steps 20 --pretrained runs/gpt2-demo
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar

try:  # the profiler is an extra; the demo trains without it
    import chunkstar_profiler
except ImportError:  # pragma: no cover
    chunkstar_profiler = None


SEED = 0  # torch's seed for the model's initial values (a real build, or the initialisers of a meta one)
NEW_MODEL = {"n_layer": 8, "n_embd": 512, "vocab": 8192}  # the shape flags' defaults (without --pretrained)
HELD_OUT_STREAM = 1  # the held-out batch's own generator: never a training batch


def markov_batches(  # type: ignore[no-untyped-def]
    vocab: int, batch: int, seq: int, seed: int = 0, states: int = 256, stream: int | None = None
):
    """Endless batches from a random Markov chain over ``states`` of the vocabulary's
    tokens, each with 2 equally likely successors: the best possible loss is ln 2.

    ``seed`` picks the chain; the batches continue its generator, or, with ``stream``,
    come from a generator of their own seeded ``stream`` (the same chain, other batches)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab, generator=g)[:states]
    successors = torch.randint(0, states, (states, 2), generator=g)
    if stream is not None:
        g = torch.Generator().manual_seed(stream)
    while True:
        state = torch.randint(0, states, (batch,), generator=g)
        rows = [state]
        for _ in range(seq - 1):
            state = successors[state, torch.randint(0, 2, (batch,), generator=g)]
            rows.append(state)
        yield tokens[torch.stack(rows, dim=1)]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def describe_construction(report: chunkstar.ConstructionReport, n_tensors: int) -> str:
    """How the chunks got their values, in words (``engine.construction``, ``n_tensors``
    the model's unique parameters)."""
    if report.meta_params == 0:
        parts = [f"built for real (torch seed {SEED}), {n_tensors} tensors copied into the chunks"]
    else:
        parts = [f"built on the meta device ({report.meta_params} tensors made in their chunks, none allocated whole)"]
    if report.pretrained is not None:
        parts.append(f"{len(report.loaded)} tensors ({mib(report.bytes_read)}) streamed from {report.pretrained}")
        if report.not_in_checkpoint:
            parts.append(f"{len(report.not_in_checkpoint)} not in the checkpoint (e.g. {report.not_in_checkpoint[0]})")
        if report.unused_keys:
            parts.append(f"{len(report.unused_keys)} checkpoint tensors unused (e.g. {report.unused_keys[0]})")
    if report.meta_params:
        if report.initialised:
            parts.append(f"initialised by the model's own initialisers (torch seed {SEED})")
        else:
            parts.append("nothing initialised")
    if report.rebuilt_buffers:
        parts.append(f"{len(report.rebuilt_buffers)} buffers rebuilt")
    return ", ".join(parts)


def save_pretrained(engine: chunkstar.ChunkEngine, directory: Path) -> Path:
    """Write the engine's model as a Hugging Face checkpoint: ``config.json`` and
    ``model.safetensors`` with the fp32 masters (a tied parameter under its first name
    only, as ``save_pretrained`` does). Returns the safetensors file.

    Not ``engine.module.save_pretrained(...)``: it records the dtype of the module's
    parameters, which are the bf16 param chunks, so ``from_pretrained`` would load the
    fp32 file as bf16."""
    state = engine.state_dict()
    for others in engine.parameter_aliases().values():
        for name in others:
            del state[name]
    config = copy.deepcopy(engine.module.config)
    config.dtype = torch.float32
    config.architectures = [type(engine.module).__name__]
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    path = directory / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    return path


@torch.no_grad()
def held_out_loss(engine: chunkstar.ChunkEngine, ids: torch.Tensor) -> float:
    """The model's loss on ``ids`` (an evaluation forward the engine's schedule ignores)."""
    return float(engine(input_ids=ids, labels=ids).loss.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="training steps (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per batch (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    for dest, what in (("n_layer", "transformer layers"), ("n_embd", "hidden size"), ("vocab", "vocabulary size")):
        # None = not given: with --pretrained a given shape is an error, not silently ignored
        ap.add_argument("--" + dest.replace("_", "-"), type=int, default=None,
                        help=f"{what} (default: {NEW_MODEL[dest]}; with --pretrained the checkpoint's config.json decides)")  # fmt: skip
    ap.add_argument("--budget-fraction", type=float, default=0.8,
                    help="device budget as a fraction of the model's bf16 parameter bytes (default: %(default)s)")  # fmt: skip
    ap.add_argument("--chunk-size", default="auto", help='elements per chunk, or "auto" (default: %(default)s)')
    ap.add_argument("--device", default="cpu", help="cpu (virtual device) or cuda[:N] (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default: %(default)s)")
    ap.add_argument("--profile", default="runs/demo.csprof",
                    help="write a chunkstar profile of the run here, '' to skip (default: %(default)s)")  # fmt: skip
    ap.add_argument("--meta", action="store_true",
                    help="build the model on the meta device: the engine creates each parameter in its chunk and "
                         "initialises it from torch's seed (default: off, the model is built for real first)")  # fmt: skip
    ap.add_argument("--pretrained", metavar="DIR", type=Path, default=None,
                    help="fine-tune a saved Hugging Face checkpoint (config.json and safetensors): the model is built "
                         "on the meta device from DIR's config.json and its tensors are streamed straight into the "
                         "chunks (default: none, a new model)")  # fmt: skip
    ap.add_argument("--save-pretrained", metavar="DIR", type=Path, default=None,
                    help="after training, save the model to DIR as a Hugging Face checkpoint (config.json and "
                         "model.safetensors, fp32), for GPT2LMHeadModel.from_pretrained or --pretrained "
                         "(default: none, not saved)")  # fmt: skip
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    if args.pretrained is not None:
        given = [f"--{f.replace('_', '-')}" for f in NEW_MODEL if getattr(args, f) is not None]
        if given:
            ap.error(f"{given[0]}: with --pretrained the model's shape comes from {args.pretrained}/config.json")
        if not (args.pretrained / "config.json").is_file():
            ap.error(f"--pretrained {args.pretrained}: no config.json there (save one with --save-pretrained)")
        cfg = GPT2Config.from_pretrained(args.pretrained)
        if args.seq > cfg.n_positions:
            ap.error(f"--seq {args.seq}: the checkpoint's model takes at most {cfg.n_positions} positions")
    else:
        shape = {f: getattr(args, f) if getattr(args, f) is not None else d for f, d in NEW_MODEL.items()}
        cfg = GPT2Config(
            vocab_size=shape["vocab"], n_positions=max(args.seq, 128), n_embd=shape["n_embd"], n_layer=shape["n_layer"],
            n_head=max(1, shape["n_embd"] // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
    if args.save_pretrained is not None and (args.save_pretrained / "model.safetensors.index.json").exists():
        # a sharded checkpoint's index would be read instead of the model.safetensors written beside it
        ap.error(f"--save-pretrained {args.save_pretrained}: it holds a sharded checkpoint; pick another directory")
    on_meta = args.meta or args.pretrained is not None

    def model_func() -> GPT2LMHeadModel:
        torch.manual_seed(SEED)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            model = GPT2LMHeadModel(cfg)
        # recompute activations in backward so they do not crowd the chunks out of the device
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    with torch.device("meta"):  # the shapes only
        n_params = sum(p.numel() for p in GPT2LMHeadModel(cfg).parameters())
    param_bytes_bf16 = 2 * n_params
    budget = int(args.budget_fraction * param_bytes_bf16)
    chunk_size = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    engine, optimizer = chunkstar.initialize_engine(
        model_func=model_func,
        local_rank=0,
        config={
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "device": args.device,
            "device_memory_budget": budget,
            "default_chunk_size": chunk_size,
        },
        param_groups_fn=chunkstar.no_decay_param_groups,
        pretrained=args.pretrained,
    )
    built = describe_construction(engine.construction, len(list(engine.parameters())))
    print(
        f"GPT-2 {n_params / 1e6:.1f}M params ({cfg.n_layer} layers, hidden {cfg.n_embd}, vocab {cfg.vocab_size}); "
        f"bf16 params {mib(param_bytes_bf16)}, device budget {mib(budget)} on {engine.device} "
        f"({args.budget_fraction:.0%} of the bf16 parameter bytes)"
    )
    # linear warm-up over the first 10 steps, through optimizer.param_groups like any torch optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    data = markov_batches(cfg.vocab_size, args.batch, args.seq)
    held_out = next(markov_batches(cfg.vocab_size, args.batch, args.seq, stream=HELD_OUT_STREAM)).to(engine.device)
    loss_before = held_out_loss(engine, held_out)
    t0 = time.perf_counter()
    first_loss = last_loss = float("nan")
    profiler = None
    if args.profile and chunkstar_profiler is not None:
        profiler = chunkstar_profiler.Profiler(engine, model_name=f"GPT-2 {n_params / 1e6:.1f}M (demo)")
        profiler.start()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        ids = next(data).to(engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        last_loss = out.loss.item()
        if step == 0:
            first_loss = last_loss
        s = engine.stats()
        bar.set_postfix(loss=f"{last_loss:.3f}", moves=s["chunk_moves_to_device"] + s["chunk_moves_to_host"])
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.stop()
        saved = profiler.save(args.profile)
    loss_after = held_out_loss(engine, held_out)
    checkpoint = save_pretrained(engine, args.save_pretrained) if args.save_pretrained is not None else None

    s = engine.stats()
    print("\nsummary")
    print(f"  model                {built}")
    print(f"  loss                 {first_loss:.3f} -> {last_loss:.3f} over {args.steps} steps ({elapsed / args.steps:.2f} s/step)")
    print(f"  held-out loss        {loss_before:.4f} before training -> {loss_after:.4f} after (one batch never trained on)")
    print(f"  device budget        {mib(s['device_budget_bytes'])}")
    print(f"  device chunk peak    {mib(s['device_chunk_bytes_peak'])}  (model data never fits: {mib(s['model_data_bytes'])})")
    print(f"  non-model peak       {mib(s['warmup_non_model_peak_bytes'])}  (measured during warm-up)")
    print(f"  model data           {s['model_data_bytes'] / s['n_params']:.2f} bytes/param in {s['n_chunks']} chunks of {s['chunk_size']:,} elements")
    print(f"  chunk moves          {s['chunk_moves_to_device']} to device ({mib(s['bytes_to_device'])}), "
          f"{s['chunk_moves_to_host']} to host ({mib(s['bytes_to_host'])})")  # fmt: skip
    print(f"  moves by reason      {', '.join(f'{n} {reason}' for reason, n in s['moves_by_reason'].items())}")
    print(f"  Adam on the device   {s['device_adam_chunks']} of {s['n_chunks']} chunks")
    if checkpoint is not None:
        print(f"  saved model          {checkpoint.parent}/ (config.json, {checkpoint.name} {mib(checkpoint.stat().st_size)}, fp32); "
              f"fine-tune it with --pretrained {checkpoint.parent}")  # fmt: skip
    if profiler is not None:
        print(f"\nprofile written to {saved}; look at it with (in the environment ./dev set up, e.g. `. .venv/bin/activate`)")
        print(f"  chunkstar-profile summary {saved}")
        print(f"  chunkstar-profile export-chrome {saved} {saved}.trace.json   # then open it in ui.perfetto.dev")
        print(f"  streamlit run dashboards/app.py -- --profile {saved}")


if __name__ == "__main__":
    main()
