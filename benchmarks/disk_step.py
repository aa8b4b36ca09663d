"""An I/O-bound step with the disk tier: per-iteration disk figures beside the disk's own speed.

    python benchmarks/disk_step.py --dir /path/on/the/disk                       # GPT-2 354M, state on disk
    python benchmarks/disk_step.py --dir /path/on/the/disk --params              # the param list on disk too
    python benchmarks/disk_step.py --dir /path/on/the/disk --layers 12 --width 768 --precision bf16

A GPT-2 (vocab 50257) built on the meta device trains a few steps of 1 x 16 tokens on
the cpu virtual device (``--device-budget``, default 1GB) with the disk tier in a
folder under ``--dir``: the state lists on disk, and with ``--params`` the param list
too. Before the run, ``chunkstar.disk.measure_disk_bandwidth`` measures the disk
(1 GB each way). After each step it prints the time in the forward, the backward and
``optimizer.step()``, and ``engine.stats()["disk_last_step"]`` over the iteration
(Note [disk busy time]): the bytes each way, the speed each lane saw, the busy
fraction, the waits for staging buffers, and the step against its I/O at the
measured speed (``bytes read / read speed + bytes written / write speed``); at
the end the host chunk peak and the process's peak RSS. A virtual disk's speed
drifts from minute to minute: compare runs made one after the other.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time

import torch

import chunkstar
from chunkstar.disk import measure_disk_bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a folder on the disk under test (a run folder is made and removed in it)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--params", action="store_true", help="the param list on disk too")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 matmuls are slow on many CPUs")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device-budget", default="1GB")
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tempfile.mkdtemp(prefix="disk-step-", dir=args.dir)
    try:
        bw = measure_disk_bandwidth(folder, 1 << 30)
        print(f"disk: write {bw.write_bytes_per_s / 1e9:.2f} GB/s, read {bw.read_bytes_per_s / 1e9:.2f} GB/s (direct: {bw.direct})")

        def build() -> torch.nn.Module:
            with torch.device("meta"):
                cfg = GPT2Config(vocab_size=50257, n_embd=args.width, n_layer=args.layers, n_head=16, n_positions=128)
                return GPT2LMHeadModel(cfg)

        lists = ["param", "master", "exp_avg", "exp_avg_sq"] if args.params else ["master", "exp_avg", "exp_avg_sq"]
        config = {"device": "cpu", "device_memory_budget": args.device_budget, "disk": {"path": folder, "lists": lists}}
        if args.precision == "bf16":
            config["bf16"] = {"enabled": True}
        torch.manual_seed(0)
        engine, opt = chunkstar.initialize_engine(build, 0, config)
        s = engine.stats()
        print(f"{s['n_params'] / 1e6:.0f}M parameters, {args.precision}, lists on disk: {', '.join(lists)}; "
              f"chunk {engine.chunk_size:,} elements, staging {s['disk_staging_budget_bytes'] / 2**20:.0f} MiB")  # fmt: skip
        ids = torch.randint(0, 50257, (1, 16))
        for i in range(args.steps):
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            line = f"step {i}: forward {t1 - t0:.1f} s, backward {t2 - t1:.1f} s, step {t3 - t2:.1f} s"
            last = engine.stats()["disk_last_step"]
            if last:
                io = last["bytes_read"] / bw.read_bytes_per_s + last["bytes_written"] / bw.write_bytes_per_s
                line += (
                    f" | iteration {last['seconds']:.1f} s, disk busy {last['busy_fraction']:.0%}, "
                    f"read {last['bytes_read'] / 1e9:.2f} GB at {(last['read_bytes_per_s'] or 0) / 1e9:.2f} GB/s, "
                    f"written {last['bytes_written'] / 1e9:.2f} GB at {(last['write_bytes_per_s'] or 0) / 1e9:.2f} GB/s, "
                    f"staging waits {last['staging_wait_s']:.1f} s; I/O at the measured speed {io:.1f} s, "
                    f"iteration / I/O {last['seconds'] / io:.2f}"
                )
            print(line, flush=True)
        s = engine.stats()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"host chunk peak {s['host_chunk_bytes_peak'] / 2**30:.2f} GiB (staging peak "
              f"{s['disk_staging_peak_bytes'] / 2**30:.2f}), peak RSS {rss:.2f} GiB")  # fmt: skip
        engine.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
