"""gpucast from Python against PyTorch's own broadcasts, in one run, 1 KiB to 1 GiB, eager.

    # one process per GPU (torchrun): gpucast.Communicator vs torch.distributed.broadcast
    torchrun --standalone --nproc-per-node 2 python/bench/broadcast.py --out results/py
    # one process, several GPUs (or ranks sharing GPU 0): gpucast.Clique vs torch
    python python/bench/broadcast.py --clique 0,1 --out results/py

In clique mode the column "gpucast from Rust" makes the same call from Rust in the same
process (a loop inside the extension), so the Python door's cost is measured in one run.

Timer: CUDA events on the timing rank's current stream around a batch of back-to-back calls,
each repeat at least --repeat-ms of work, the median and spread of --repeats repeats; the
columns of one size are measured interleaved, repeat by repeat. Writes broadcast.csv and
table.txt (headed by the commit and the command) under --out.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch

import gpucast

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


#: Calls per Python call of the "gpucast from Rust" column.
RUST_LOOP = 64


def sizes(lo, hi, factor):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def batch_seconds(fn, n, sync, devices=None):
    """Seconds for `n` back-to-back calls of `fn`, by CUDA events on the current stream of
    every GPU of `devices` (default: the current one): the longest span counts."""
    devices = [torch.cuda.current_device()] if devices is None else devices
    new = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    starts, ends = [new() for _ in devices], [new() for _ in devices]
    sync()
    for e, d in zip(starts, devices):
        e.record(torch.cuda.current_stream(d))
    for _ in range(n):
        fn()
    for e, d in zip(ends, devices):
        e.record(torch.cuda.current_stream(d))
    for e in ends:
        e.synchronize()
    return max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def calibrate(fn, sync, repeat_s, agree, devices=None):
    """Calls per repeat so that one repeat takes at least `repeat_s` (agreed by every rank)."""
    n = 1
    while True:
        t = batch_seconds(fn, n, sync, devices)
        if agree(t >= repeat_s / 4 or n >= 1 << 20):
            return max(1, int(n * repeat_s / max(t, 1e-9)) + 1)
        n *= 4


def measure(columns, repeats, repeat_s, sync, agree, devices=None):
    """Per column: (median, min, max) seconds per call, columns interleaved per repeat."""
    counts = {name: calibrate(fn, sync, repeat_s, agree, devices) for name, fn in columns}
    for name, fn in columns:
        counts[name] = int(agree(counts[name]))
    times = {name: [] for name, _ in columns}
    for _ in range(repeats):
        for name, fn in columns:
            n = counts[name]
            times[name].append(batch_seconds(fn, n, sync, devices) / n)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def header(args):
    # The commit the staged package was built from comes first: a copy's .git may be stale.
    commit = os.environ.get("GPUCAST_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    name = torch.cuda.get_device_name(0)
    try:
        with open("/proc/driver/nvidia/version") as f:
            # "NVRM version: NVIDIA UNIX [Open ]Kernel Module for x86_64  580.159.04  Release ..."
            found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
            driver = found.group(1) if found else "?"
    except (OSError, IndexError):
        driver = "?"
    try:
        import torch.cuda.nccl as tnccl

        v = tnccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a header field, not worth failing the run over
        nccl = "?"
    return (f"# commit {commit}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{torch.cuda.device_count()} x {name}; driver {driver}; torch {torch.__version__} "
            f"(its NCCL {nccl}); gpucast (Python) {gpucast.__version__}\n"
            f"# command: {' '.join(sys.argv)}\n")


def write(args, rows, names, setting):
    os.makedirs(args.out, exist_ok=True)
    head = header(args)
    with open(os.path.join(args.out, "broadcast.csv"), "w") as f:
        f.write(head)
        f.write("setting,bytes,column,median_us,min_us,max_us,gb_per_s\n")
        for size, res in rows:
            for n in names:
                med, lo, hi = res[n]
                f.write(f"{setting},{size},{n},{med * 1e6:.3f},{lo * 1e6:.3f},{hi * 1e6:.3f},"
                        f"{size / med / 1e9:.3f}\n")
    lines = [head, f"# {setting}; microseconds per call (median of repeats, [min-max]); "
                   f"last columns: the first column's speed-up over each other\n"]
    lines.append(f"{'bytes':>10} " + " ".join(f"{n:>26}" for n in names)
                 + "".join(f" {'x ' + n:>22}" for n in names[1:]))
    for size, res in rows:
        cells = " ".join(f"{res[n][0] * 1e6:>10.2f} [{res[n][1] * 1e6:.1f}-{res[n][2] * 1e6:.1f}]"
                         .rjust(26) for n in names)
        ratios = "".join(f" {res[n][0] / res[names[0]][0]:>22.2f}" for n in names[1:])
        lines.append(f"{size:>10} {cells}{ratios}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text)
    print(text)


def run_clique(args):
    devices = [int(d) for d in args.clique.split(",")]
    shared = len(set(devices)) < len(devices)
    clique = gpucast.Clique(devices, shared_devices=shared)
    rows = []
    for size in sizes(parse_bytes(args.min), parse_bytes(args.max), args.factor):
        n = size // 4
        x = torch.randn(n, device=f"cuda:{devices[0]}")
        outs = [torch.empty(n, device=f"cuda:{d}") for d in devices]
        # The same call made from Rust (`clique.with(&options).broadcast` on the same tensors, wrapped
        # once, RUST_LOOP calls back to back per Python call): the first two columns' gap is
        # the cost of the Python door (argument parsing, reading the tensors, the streams,
        # the GIL, keeping the tensors alive).
        columns = [("gpucast", lambda: clique.broadcast(0, x, outs)),
                   ("gpucast from Rust",
                    lambda: clique._rust_loop(0, x, outs, RUST_LOOP)),
                   ("gpucast-p2p", lambda: clique.broadcast(0, x, outs, path="p2p"))]
        if shared:
            # One GPU: torch's own way to fill every output, a copy per rank.
            def copies():
                for o in outs:
                    o.copy_(x)
            columns.append(("torch copy_ per rank", copies))
        else:
            columns.append(("torch.cuda.comm.broadcast",
                            lambda: torch.cuda.comm.broadcast(x, out=outs)))
        gpus = sorted(set(devices))

        def sync_all():
            for d in gpus:
                torch.cuda.synchronize(d)

        res = measure(columns, args.repeats, args.repeat_ms / 1e3, sync_all, lambda v: v, gpus)
        res["gpucast from Rust"] = tuple(v / RUST_LOOP for v in res["gpucast from Rust"])
        rows.append((size, res))
        print(size, {k: f"{v[0] * 1e6:.2f}" for k, v in res.items()}, flush=True)
    names = [c for c, _ in columns]
    setting = f"one process, clique {devices}" + (" (ranks share a GPU)" if shared else "")
    write(args, rows, names, setting)


def run_communicator(args):
    local = int(os.environ.get("LOCAL_RANK", "0"))
    shared = torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = 0 if shared else local
    torch.cuda.set_device(device)
    comm = gpucast.Communicator.from_env(device=device, shared_devices=shared)
    dev = f"cuda:{device}"
    dist = None
    if not shared:
        import torch.distributed as dist

        dist.init_process_group("nccl", device_id=torch.device(dev))
    flag = torch.zeros(1, device=dev)

    def agree(v):
        """Rank 0's value, on every rank (through gpucast itself)."""
        flag.fill_(float(v))
        comm.broadcast(flag, src=0)
        return flag.item()

    def sync():
        comm.synchronize()
        torch.cuda.synchronize()
        agree(0)

    rows = []
    for size in sizes(parse_bytes(args.min), parse_bytes(args.max), args.factor):
        t = torch.randn(size // 4, device=dev)
        columns = [("gpucast", lambda: comm.broadcast(t, src=0))]
        if dist is not None:
            columns.append(("torch.distributed", lambda: dist.broadcast(t, src=0)))
        res = measure(columns, args.repeats, args.repeat_ms / 1e3, sync, agree)
        rows.append((size, res))
        if comm.rank == 0:
            print(size, {k: f"{v[0] * 1e6:.2f}" for k, v in res.items()}, flush=True)
    names = [c for c, _ in columns]
    if comm.rank == 0:
        setting = (f"{comm.world_size} processes, "
                   + ("all on GPU 0 (shared-device mode; no torch.distributed)" if shared
                      else "one GPU each"))
        write(args, rows, names, setting)
    if dist is not None:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clique", help="one process: comma-separated GPUs (repeat one to share)")
    ap.add_argument("-b", "--min", default="1K")
    ap.add_argument("-e", "--max", default="1G")
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--repeat-ms", type=float, default=200.0)
    ap.add_argument("--out", default="target/py-bench")
    args = ap.parse_args()
    os.environ.update(SAFE_ENV)
    if args.clique:
        run_clique(args)
    else:
        run_communicator(args)


if __name__ == "__main__":
    main()
