"""The main job: train a Hugging Face GPT-2 with chunkstar under a device budget
smaller than the model's parameter bytes.

The model is built from a config (no download). The data is a synthetic but
learnable token stream (a fixed random Markov chain), so the loss visibly
falls. On a machine without a GPU the device is chunkstar's CPU virtual device:
the budget is enforced exactly as it would be on a GPU, and every chunk move is
a real copy.

    python examples/train_gpt2.py --steps 50
    python examples/train_gpt2.py --quick       # a smaller model for 30 steps: the same path, about a quarter of the time

Comparing two runs: each writes a profile (``--profile``); the dashboard's Compare
page and ``chunkstar-profile view A --compare B`` put two side by side (the summary
prints the commands for a second run with another budget).

    python examples/train_gpt2.py --budget-fraction 1.2 --profile runs/demo-budget1.2.csprof
    chunkstar-profile view runs/demo.csprof --compare runs/demo-budget1.2.csprof

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
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

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
RUN = {"steps": 50, "seq": 128}  # the run flags' defaults
# --quick's defaults: a 12.3M model, shorter sequences, fewer steps. Its activations still leave the chunks
# room at 80% (the loss's fp32 logits, batch x seq x vocab, are the largest non-model tensor: all three shrink)
QUICK = {"steps": 30, "seq": 64, "n_layer": 6, "n_embd": 384, "vocab": 4096}
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


def size(n: float) -> str:
    """Bytes in MiB, or in GiB from 1 GiB up."""
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def table(rows: list[tuple[str, str, str]], indent: str = "  ") -> str:
    """Rows of (label, value, note): labels left-aligned, values right-aligned, notes after."""
    wl = max(len(r[0]) for r in rows)
    wv = max(len(r[1]) for r in rows)
    return "\n".join(f"{indent}{a:<{wl}}  {b:>{wv}}  {c}".rstrip() for a, b, c in rows)


def least_fraction(minimum: int, param_bytes: int) -> float:
    """The smallest --budget-fraction (two decimals) whose budget is at least ``minimum`` bytes."""
    f = math.ceil(minimum / param_bytes * 100) / 100
    while int(f * param_bytes) < minimum:
        f += 0.01
    return round(f, 2)


def too_small_message(
    err: chunkstar.DeviceMemoryError, args: argparse.Namespace, budget: int, param_bytes: int, doing: str
) -> str:
    """The engine's budget error (raised during ``doing``) in this script's terms: which
    --budget-fraction would do, and what else helps."""
    non_model = err.budget - err.free  # the free chunk memory is what the non-model memory left of the budget
    moment = err.where.split(", whose")[0]  # "the warm-up iteration's moment 'lm_head' (fwd)"
    lines = [
        f"error: a device budget of {size(budget)} (--budget-fraction {args.budget_fraction:g} of the "
        f"{size(param_bytes)} of bf16 parameters) is too small for this run:",
        f"  in {doing}, {moment} needs {size(err.needed)} of chunks on the device beside "
        + (f"{size(non_model)}" if err.free > 0 else f"more than {size(err.budget)}")
        + " of non-model memory (activations, the loss's fp32 logits, gradients before they reach their chunks)",
    ]
    if err.minimum is not None:
        # the held-out evaluation fits wherever training does (Note [evaluation budgets])
        lines.append(
            f"  the smallest budget that holds what was measured is {size(err.minimum)}: "
            f"rerun with --budget-fraction {least_fraction(err.minimum, param_bytes):g} (or more)"
        )
    else:
        lines.append("  rerun with a larger --budget-fraction")
    lines.append(f"  or shrink the non-model memory, which grows with --batch ({args.batch}) x --seq ({args.seq}) x the vocabulary")
    if "lower 'default_chunk_size'" in str(err):  # the engine knows whether smaller chunks can help
        lines.append("  or pass a smaller --chunk-size, so the moment needs fewer whole chunks")
    lines.append(f"(the engine said: {err})")
    return "\n".join(lines)


def rerun_command(budget_fraction: float, profile: str) -> str:
    """This run's command line with another budget and profile (and without --save-pretrained)."""
    drop = {"--budget-fraction", "--profile", "--save-pretrained"}
    argv, kept = sys.argv[1:], []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in drop:
            i += 1 if "=" in argv[i] else 2
            continue
        kept.append(argv[i])
        i += 1
    return shlex.join(["python", "examples/train_gpt2.py", *kept, "--budget-fraction", f"{budget_fraction:g}", "--profile", profile])


def describe_construction(report: chunkstar.ConstructionReport, n_tensors: int) -> str:
    """How the chunks got their values, in words (``engine.construction``, ``n_tensors``
    the model's unique parameters)."""
    if report.meta_params == 0:
        parts = [f"built for real (torch seed {SEED}), {n_tensors} tensors copied into the chunks"]
    else:
        parts = [f"built on the meta device ({report.meta_params} tensors made in their chunks, none allocated whole)"]
    if report.pretrained is not None:
        parts.append(f"{len(report.loaded)} tensors ({size(report.bytes_read)}) streamed from {report.pretrained}")
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
    # the defaults of --steps, --seq and the shape flags depend on --quick (None = not given: filled in below)
    ap.add_argument("--quick", action="store_true",
                    help=f"a short run: a smaller GPT-2 ({QUICK['n_layer']} layers, hidden {QUICK['n_embd']}, vocab "
                         f"{QUICK['vocab']}), {QUICK['seq']}-token sequences, {QUICK['steps']} steps; "
                         "still under a budget smaller than its parameters, with eviction; flags given beside it win "
                         "(default: off)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None,
                    help=f"training steps (default: {RUN['steps']}; with --quick {QUICK['steps']})")  # fmt: skip
    ap.add_argument("--batch", type=int, default=2, help="sequences per batch (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=None,
                    help=f"tokens per sequence (default: {RUN['seq']}; with --quick {QUICK['seq']})")  # fmt: skip
    for dest, what in (("n_layer", "transformer layers"), ("n_embd", "hidden size"), ("vocab", "vocabulary size")):
        # None = not given: with --pretrained a given shape is an error, not silently ignored
        ap.add_argument("--" + dest.replace("_", "-"), type=int, default=None,
                        help=f"{what} (default: {NEW_MODEL[dest]}; with --quick {QUICK[dest]}; with --pretrained "
                             "the checkpoint's config.json decides)")  # fmt: skip
    ap.add_argument("--budget-fraction", type=float, default=0.8,
                    help="device budget as a fraction of the model's bf16 parameter bytes (the model data, 14 bytes "
                         "a parameter, is 7x those, so below 7 chunks must move) (default: %(default)s)")  # fmt: skip
    ap.add_argument("--chunk-size", default="auto",
                    help='elements per chunk, or "auto": the size wasting the least space (default: %(default)s)')  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu (virtual device) or cuda[:N] (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="AdamW peak learning rate, reached after a 10-step linear warm-up (default: %(default)s)")  # fmt: skip
    ap.add_argument("--profile", default="runs/demo.csprof",
                    help="write a chunkstar profile of the run here, '' to skip; a second run with another "
                         "--profile gives a second one to compare (default: %(default)s)")  # fmt: skip
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
    defaults = {**RUN, **NEW_MODEL, **(QUICK if args.quick else {})}
    for f in RUN:
        if getattr(args, f) is None:
            setattr(args, f, defaults[f])

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
        shape = {f: getattr(args, f) if getattr(args, f) is not None else defaults[f] for f in NEW_MODEL}
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
    model_desc = f"GPT-2 {n_params / 1e6:.1f}M params ({cfg.n_layer} layers, hidden {cfg.n_embd}, vocab {cfg.vocab_size})"
    print(
        f"{model_desc}; bf16 params {size(param_bytes_bf16)}, device budget {size(budget)} on {engine.device} "
        f"({args.budget_fraction:.0%} of the bf16 parameter bytes); {args.steps} steps of {args.batch} x {args.seq} tokens"
    )
    # linear warm-up over the first 10 steps, through optimizer.param_groups like any torch optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    data = markov_batches(cfg.vocab_size, args.batch, args.seq)
    held_out = next(markov_batches(cfg.vocab_size, args.batch, args.seq, stream=HELD_OUT_STREAM)).to(engine.device)
    first_loss = last_loss = float("nan")
    profiler = None
    if args.profile and chunkstar_profiler is not None:
        # the budget in the name tells two profiles of the demo apart on the Compare page
        name = f"GPT-2 {n_params / 1e6:.1f}M (demo, budget fraction {args.budget_fraction:g})"
        profiler = chunkstar_profiler.Profiler(engine, model_name=name)
        profiler.start()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    steady_steps, steady_s = 0, 0.0  # steps that began with the schedule frozen (warm-up tracing done)
    s = engine.stats()
    doing = "the held-out evaluation before training"  # for a budget error's message
    try:
        loss_before = held_out_loss(engine, held_out)
        t0 = time.perf_counter()
        for step in bar:
            doing = f"training step {step + 1}"
            frozen = s["schedule"] == "frozen"
            t_step = time.perf_counter()
            ids = next(data).to(engine.device)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            last_loss = out.loss.item()
            if frozen:
                steady_steps += 1
                steady_s += time.perf_counter() - t_step
            if step == 0:
                first_loss = last_loss
            s = engine.stats()
            bar.set_postfix(loss=f"{last_loss:.3f}", moves=s["chunk_moves_to_device"] + s["chunk_moves_to_host"])
        elapsed = time.perf_counter() - t0
        if profiler is not None:
            profiler.stop()
            saved = profiler.save(args.profile)
        # an evaluation forward after the warm-up plans with the trace's largest non-model peak, so it
        # can be what does not fit: the same advice
        doing = f"the held-out evaluation after {args.steps} training steps"
        loss_after = held_out_loss(engine, held_out)
    except chunkstar.DeviceMemoryError as err:
        bar.close()
        raise SystemExit(too_small_message(err, args, budget, param_bytes_bf16, doing)) from None
    checkpoint = save_pretrained(engine, args.save_pretrained) if args.save_pretrained is not None else None
    print_summary(engine.stats(), model_desc, built, args, elapsed, (steady_steps, steady_s),
                  (first_loss, last_loss, loss_before, loss_after), next(engine.parameters()).dtype.itemsize)  # fmt: skip
    if checkpoint is not None:
        print(f"\nsaved model  {checkpoint.parent}/ (config.json, {checkpoint.name} {size(checkpoint.stat().st_size)}, fp32); "
              f"fine-tune it with --pretrained {checkpoint.parent}")  # fmt: skip
    if profiler is not None:
        print_profile_commands(str(saved), args.budget_fraction)


def print_summary(
    s: dict[str, Any], model_desc: str, built: str, args: argparse.Namespace, elapsed: float,
    steady: tuple[int, float], losses: tuple[float, float, float, float], param_itemsize: int,
) -> None:  # fmt: skip
    """The run's figures as an aligned table (``s`` is ``engine.stats()``, ``param_itemsize``
    the bytes of one element of the param chunks)."""
    first_loss, last_loss, loss_before, loss_after = losses
    steady_steps, steady_s = steady
    # model data per parameter: every chunk element costs the same (bf16 param/grad 2 + fp32 master 4 + Adam 4 + 4
    # = 14), and the chunks hold more elements than the model has parameters: the rest is padding at chunk ends
    elements = (s["model_data_bytes"] - s["master_and_adam_bytes"]) // param_itemsize
    per_element = s["model_data_bytes"] / elements
    padding = elements - s["n_params"]
    per_param = s["model_data_bytes"] / s["n_params"]
    step_time = f"{elapsed / args.steps:.2f} s/step"
    step_note = f"{args.steps} steps in {elapsed:.1f} s"
    if steady_steps and steady_steps < args.steps:
        step_note += f"; {steady_s / steady_steps:.2f} s/step after the {args.steps - steady_steps} traced warm-up steps"
    reasons = ", ".join(f"{n} {reason}" for reason, n in s["moves_by_reason"].items() if n)
    print("\nsummary")
    print(f"  model          {model_desc}: {built}")
    print(f"  loss           {first_loss:.3f} -> {last_loss:.3f} over {args.steps} steps")
    print(f"  held-out loss  {loss_before:.4f} before training -> {loss_after:.4f} after (one batch never trained on)")
    print()
    rows = [
        ("device budget", size(s["device_budget_bytes"]), f"{args.budget_fraction:.0%} of the bf16 parameter bytes"),
        ("device chunk peak", size(s["device_chunk_bytes_peak"]), "chunk bytes on the device at once, at most"),
        ("non-model peak", size(s["warmup_non_model_peak_bytes"]), "activations and temporaries, measured during warm-up"),
        ("device peak", size(s["device_peak_bytes"]),
         "all the device held at once: chunks until really freed, beside activations"
         + ("" if "1" in (os.environ.get("CHUNKSTAR_DEVICE_METER"), os.environ.get("CHUNKSTAR_STRICT_DEVICE"))
            else " (warm-up; CHUNKSTAR_DEVICE_METER=1: every step)")
         + (f"; OVER THE BUDGET, first: {s['device_first_overrun']}" if s["device_first_overrun"] else "")),
        ("model data", size(s["model_data_bytes"]),
         f"{s['model_data_bytes'] / s['device_budget_bytes']:.1f}x the budget: never all on the device"),
        ("bytes/param", f"{per_param:.2f}",
         f"{per_element:.0f} per chunk element (bf16 param/grad 2, fp32 master 4, Adam 4 + 4)"
         + (f" + {per_param - per_element:.2f} of padding" if padding > 0 else "")),
        ("padding", size(padding * per_element),
         f"{padding / elements:.1%} of the chunks' {elements / 1e6:.1f}M elements hold no parameter: "
         "the unused end of a chunk whose next tensor did not fit"),
        ("chunks", f"{s['n_chunks']}", f"of {s['chunk_size']:,} elements (a parameter larger gets one of its own)"),
        ("to the device", size(s["bytes_to_device"]), f"in {s['chunk_moves_to_device']:,} chunk moves"),
        ("to the host", size(s["bytes_to_host"]), f"in {s['chunk_moves_to_host']:,} chunk moves"),
        ("moves by reason", "", reasons),
        ("Adam on the device", f"{s['device_adam_chunks']}", f"of {s['n_chunks']} chunks"),
        ("time", step_time, step_note),
    ]  # fmt: skip
    print(table(rows))


def print_profile_commands(saved: str, budget_fraction: float) -> None:
    """How to look at the profile, and how to make a second one and compare the two."""
    other_fraction = round(budget_fraction * 1.5, 2)  # a larger budget always fits: fewer moves to compare
    stem = saved[: -len(".csprof")] if saved.endswith(".csprof") else saved
    other = f"{stem}-budget{other_fraction:g}.csprof"
    print(f"\nprofile written to {saved}; to look at it (in the environment ./dev set up: `. .venv/bin/activate`;"
          " view and compare open the dashboard):")
    print(f"  summary:    chunkstar-profile summary {saved}")
    print(f"  trace:      chunkstar-profile export-chrome {saved} {saved}.trace.json   # open it in ui.perfetto.dev")
    print(f"  view:       chunkstar-profile view {saved}")
    print(f"  compare:    rerun with --budget-fraction {other_fraction:g} --profile {other}, then "
          f"chunkstar-profile view {saved} --compare {other}")
    print(f"              (the rerun: {rerun_command(other_fraction, other)})")


if __name__ == "__main__":
    main()
