"""Construction beyond host memory: build a zoo model whose fp32 weights alone exceed host
memory from a meta-device model_func (and, with --pretrained, from a checkpoint of it), with
the optimizer state on disk, and report the peak host memory of the process.

    python benchmarks/construct_scale.py --model cpu-3b --disk /work/diskbench --chunk-size 26227968 --staging 1.55GB
    python benchmarks/construct_scale.py --model cpu-3b --disk /work/diskbench --write-checkpoint DIR   # then:
    python benchmarks/construct_scale.py ... --pretrained DIR

The peak is the process's maximum resident set (ru_maxrss). Construction only: no
training step (the device budget is not touched until the first forward).
"""

from __future__ import annotations

import argparse
import resource
import os
import time

import torch

import chunkstar
from chunkstar_bench.zoo import build_hf, get, n_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cpu-3b", help="zoo model (default %(default)s)")
    ap.add_argument("--disk", required=True, help="directory for the disk tier's chunk files (on the disk under test)")
    ap.add_argument("--staging", default=None, help='disk staging budget, e.g. "1.6GB" (default: the engine\'s least that works)')
    ap.add_argument("--chunk-size", default="auto", help='elements per chunk or "auto" (default %(default)s)')
    ap.add_argument("--pretrained", default=None, help="a safetensors checkpoint of the model to stream in (default: initialise)")
    ap.add_argument("--write-checkpoint", default=None, metavar="DIR",
                    help="only write a bf16 checkpoint of the model (seeded random values, tensor by tensor) to DIR/model.safetensors")
    args = ap.parse_args()
    spec = get(args.model)

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return build_hf(spec)

    # one fixed folder: a run that was killed leaves its files there, and the next one wipes them
    if args.write_checkpoint:
        from chunkstar.construction.pretrained import write_safetensors

        os.makedirs(args.write_checkpoint, exist_ok=True)
        model = build()
        spec_list = [(n, tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters()]  # tied: once
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        size = write_safetensors(
            os.path.join(args.write_checkpoint, "model.safetensors"), spec_list,
            lambda name, out: out.copy_(torch.randn(out.numel(), generator=gen) * 0.02),
        )  # fmt: skip
        print(f"wrote {size / 2**30:.2f} GiB ({len(spec_list)} tensors, bf16) in {time.perf_counter() - t0:.0f} s; "
              f"peak so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30:.2f} GiB")
        return  # construct from it in a process of its own: python ... --pretrained DIR
    disk: dict[str, object] = {"path": os.path.join(args.disk, "chunkstar-construct"), "on_stale": "wipe"}
    disk["staging_budget"] = args.staging or "auto"
    chunk = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    config = {"device": "cpu", "device_memory_budget": "4GB", "bf16": {"enabled": True}, "disk": disk, "default_chunk_size": chunk}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    engine, _ = chunkstar.initialize_engine(build, 0, config, pretrained=args.pretrained)
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n = n_params(spec)
    s = engine.stats()
    how = f"streamed {engine.construction.bytes_read / 1e9:.2f} GB from {args.pretrained}" if args.pretrained else "initialised"
    print(f"{args.model}: {n / 1e9:.2f}B parameters ({4 * n / 2**30:.1f} GiB in fp32), built on the meta device, {how}, in {took:.0f} s")
    print(f"peak host memory {peak / 2**30:.2f} GiB ({peak / n:.2f} B/param); param chunks {s['model_data_bytes'] - s['master_and_adam_bytes']:,} B "
          f"in memory, optimizer state {s['disk_file_bytes'] / 2**30:.1f} GiB on disk, staging {s['disk_staging_budget_bytes'] / 2**30:.2f} GiB")
    engine.close()


if __name__ == "__main__":
    main()
