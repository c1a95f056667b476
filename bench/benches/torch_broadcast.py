#!/usr/bin/env python3
"""PyTorch side of gpucast's broadcast benchmark.

Times PyTorch ways of broadcasting one GPU's tensor to the others, by the same
method as the Rust bench (benches/broadcast.rs), and writes rows in the bench's CSV
schema so that the bench (or benches/report) can put them side by side:

* torch-comm: torch.cuda.comm.broadcast in this process (NCCL in one process, into
  preallocated outputs when this torch has the out= argument); eager mode only.
* torch-dist: torch.distributed.broadcast, one process per GPU, NCCL backend, rendezvous
  through a file (no network); eager, and graph (iters broadcasts captured in one
  torch.cuda.CUDAGraph per rank, then replayed) when capture works.
* torch-symm (--which symm; the one-process-per-GPU bench asks for it): PyTorch's
  symmetric-memory one-shot all-reduce (torch.distributed._symmetric_memory: symm_mem.empty,
  symm_mem.rendezvous, torch.ops.symm_mem.one_shot_all_reduce(_out), "sum") standing in for a
  broadcast: the root's buffer holds the data and every other rank's is zero, so every rank
  ends with the root's data, each reading every peer's buffer over NVLink. One process per GPU,
  timed like torch-dist, eager and graph. A torch without it (or a dtype it does not take; it
  takes float32 and bfloat16) skips these rows with the reason printed.

Method, per size: check the outputs once against the root's data; warm up; pick the
iterations per repeat so that a repeat holds about --target-ms of work (measured, within
[--min-iters, --max-iters]); then per repeat synchronize every GPU, record a CUDA event on
every GPU's current stream, issue the iterations back to back (or replay the graph), record
a second event on every GPU's current stream, synchronize; the repeat lasts as long as the
longest span between a GPU's two events (the Rust bench's timer, benches/timer/mod.rs), and
time per op = that span / iters. The median over repeats is reported with min and max. The
iterations rotate over several buffer sets (as many as fit a pool of max(512 MiB, 2 x the
largest size), between 2 and 64) so that small sizes do not sit in L2. With one process per
GPU every rank synchronizes and meets in a barrier before it records its first event, and
the time of a repeat is the longest span over the ranks.

This script is a separate run: the Rust bench starts it after its own paths are measured and
their GPU state released, so its rows are not interleaved with the Rust paths' repeats;
compare them with those of the same run only, and expect drift between the two.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 unless already set; torch-symm's one-shot all-reduce uses no multicast.
torch is imported only once the arguments are parsed, so --help works without it.
"""

import os

# Before torch (and NCCL) load, here and in every spawned worker (which re-imports this).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

CSV_HEADER = [
    "gpus", "mode", "path", "route", "bytes", "count", "dtype", "root",
    "time_us", "min_us", "max_us", "algbw_gbps", "busbw_gbps",
]

# Accepted --dtype spellings -> (torch attribute, gpucast name).
DTYPES = {}
for _torch_name, _short, _aliases in [
    ("float32", "f32", ["fp32", "float"]),
    ("float64", "f64", ["fp64", "double"]),
    ("float16", "f16", ["fp16", "half"]),
    ("bfloat16", "bf16", []),
    ("int8", "i8", []),
    ("uint8", "u8", []),
    ("int32", "i32", ["int"]),
    ("uint32", "u32", []),
    ("int64", "i64", ["long"]),
    ("uint64", "u64", []),
]:
    for _name in [_torch_name, _short] + _aliases:
        DTYPES[_name] = (_torch_name, _short)


def parse_size(s):
    """'4096', '1K', '64KiB', '1M', '1G' (powers of 1024) -> bytes; ValueError otherwise."""
    t = s.strip()
    i = 0
    while i < len(t) and t[i].isdigit():
        i += 1
    if i == 0:
        raise ValueError(f"bad size {s!r}")
    units = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB,
             "mib": MIB, "g": GIB, "gb": GIB, "gib": GIB, "t": TIB, "tb": TIB, "tib": TIB}
    unit = units.get(t[i:].strip().lower())
    if unit is None:
        raise ValueError(f"bad size {s!r}")
    return int(t[:i]) * unit


def format_size(n):
    if n == 0:
        return "0"
    for unit, suffix in [(TIB, "T"), (GIB, "G"), (MIB, "M"), (KIB, "K")]:
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def parse_sizes(spec, factor):
    """'1K:1G' (times --factor), '1K:1G:4' (own factor) or a comma list '1K,64K,1M'."""
    if "," in spec:
        return [parse_size(p) for p in spec.split(",") if p.strip()]
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad --sizes {spec!r}")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        f = int(parts[2]) if len(parts) == 3 else factor
        if lo <= 0 or lo > hi or f < 2:
            raise ValueError(f"bad --sizes {spec!r} (factor {f})")
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= f
        return out
    return [parse_size(spec)]


def split_list(s, allowed, what):
    items = [x.strip() for x in s.split(",") if x.strip()]
    for x in items:
        if x not in allowed:
            raise SystemExit(f"unknown {what} {x!r} (expected one of {', '.join(allowed)})")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch broadcast timings (torch.cuda.comm and torch.distributed) "
                    "in gpucast's bench CSV schema.")
    p.add_argument("--sizes", default="1K:1G",
                   help="'MIN:MAX' (times --factor), 'MIN:MAX:FACTOR', or a comma list (default 1K:1G)")
    p.add_argument("--factor", type=int, default=2, help="size step for MIN:MAX (default 2)")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default), bfloat16, float16, float64, int8, uint8, int32, "
                        "uint32, int64, uint64, or gpucast names (f32, bf16, ...)")
    p.add_argument("--root", type=int, default=0, help="root GPU (default 0)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use: 0..N-1 (default all)")
    p.add_argument("--iters", type=int, default=0,
                   help="broadcasts per repeat; 0 (default) picks them from --target-ms")
    p.add_argument("--target-ms", type=float, default=20.0,
                   help="work per repeat when --iters is 0 (default 20 ms)")
    p.add_argument("--min-iters", type=int, default=4, help="least iterations per repeat (default 4)")
    p.add_argument("--max-iters", type=int, default=2000, help="most iterations per repeat (default 2000)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up broadcasts per size (default min(iters, 50))")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per point (default 15)")
    p.add_argument("--modes", default="eager,graph", help="eager,graph (default both)")
    p.add_argument("--which", default="comm,dist",
                   help="comm, dist, symm (default comm,dist)")
    p.add_argument("--pool-mb", type=int, default=0,
                   help="rotation pool per GPU in MiB (default max(512, 2 x largest size))")
    p.add_argument("--timeout-s", type=int, default=300,
                   help="torch.distributed timeout for one collective (default 300 s)")
    p.add_argument("--csv", default=None, help="write rows here (gpucast bench schema)")
    a = p.parse_args(argv)
    try:
        a.size_list = parse_sizes(a.sizes, a.factor)
    except ValueError as e:
        p.error(str(e))
    if a.dtype not in DTYPES:
        p.error(f"unknown --dtype {a.dtype!r}")
    a.mode_list = split_list(a.modes, ["eager", "graph"], "mode")
    a.which_list = split_list(a.which, ["comm", "dist", "symm"], "path")
    if a.repeats < 1 or a.min_iters < 1 or a.max_iters < a.min_iters or a.iters < 0:
        p.error("need --repeats >= 1, 1 <= --min-iters <= --max-iters, --iters >= 0")
    return a


# ----------------------------------------------------------------------------------------
# Helpers shared by both paths (torch passed in, as it is imported lazily).


def sets_for(nbytes, pool):
    return max(2, min(64, pool // max(1, nbytes)))


def fill_pattern(torch, buf_u8, seed):
    """Fills a uint8 CUDA tensor with a position-dependent pattern, in chunks."""
    n = buf_u8.numel()
    chunk = 1 << 24
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        buf_u8[start:end].copy_(pattern_chunk(torch, start, end, seed, buf_u8.device))


def pattern_chunk(torch, start, end, seed, device):
    # Integer arithmetic only, so every device computes the same bytes (int64 products
    # that overflow, past 2**31 bytes, wrap the same way everywhere).
    idx = torch.arange(start, end, dtype=torch.int64, device=device)
    offset = (seed * 0x85EBCA77 + 0x165667B1) % (1 << 40)
    v = idx * 0x9E3779B1 + offset
    v = v ^ (v >> 15) ^ (v >> 29)
    return (v & 0xFF).to(torch.uint8)


def matches_pattern(torch, buf_u8, seed):
    n = buf_u8.numel()
    chunk = 1 << 24
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        if not torch.equal(buf_u8[start:end], pattern_chunk(torch, start, end, seed, buf_u8.device)):
            return False
    return True


def pick_iters(args, timed):
    """Iterations per repeat: --iters, or measured so that a repeat takes --target-ms.

    `timed(n)` runs n ops and returns the elapsed seconds (identical on every rank)."""
    if args.iters > 0:
        return args.iters
    n = 2
    while True:
        elapsed = timed(n)
        if elapsed >= 2e-3 or n >= 256:
            break
        n *= 4
    est_us = max(elapsed / n * 1e6, 1e-3)
    return int(min(args.max_iters, max(args.min_iters, args.target_ms * 1e3 / est_us)))


def event_span(torch, devices, run, n):
    """Seconds from a CUDA event on each of `devices`' current streams before run(n) to one
    after it, the longest over the devices (the GPU stamps both, so the host's wait for the
    end adds nothing)."""
    def marks():
        out = []
        for d in devices:
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(d))
            out.append(e)
        return out

    starts = marks()
    run(n)
    ends = marks()
    for e in ends:
        e.synchronize()
    return max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def make_row(args, gpus, mode, path, nbytes, count, samples_us):
    med = statistics.median(samples_us)
    algbw = nbytes / med / 1e3 if med > 0 else 0.0
    return {
        "gpus": gpus, "mode": mode, "path": path, "route": "-", "bytes": nbytes,
        "count": count, "dtype": DTYPES[args.dtype][1], "root": args.root,
        "time_us": med, "min_us": min(samples_us), "max_us": max(samples_us),
        "algbw_gbps": algbw, "busbw_gbps": algbw,  # busbw factor 1 for broadcast
    }


def element_sizes(torch, args):
    """[(bytes, count)] for the sweep, rounded down to whole elements (sizes below one
    element are dropped)."""
    dtype = getattr(torch, DTYPES[args.dtype][0])
    item = torch.empty(0, dtype=dtype).element_size()
    out = []
    for s in args.size_list:
        count = s // item
        if count >= 1 and (count * item, count) not in out:
            out.append((count * item, count))
    return dtype, out


# ----------------------------------------------------------------------------------------
# torch-comm: torch.cuda.comm.broadcast in this process.


def run_comm(torch, args, gpus, pool):
    dtype, sizes = element_sizes(torch, args)
    devices = list(range(gpus))
    root = args.root
    others = [d for d in devices if d != root]
    rows, failed = [], False
    if "graph" in args.mode_list:
        print("# torch-comm: graph mode skipped (a single-process multi-GPU NCCL "
              "broadcast is not captured in one CUDA graph); eager only")
    if "eager" not in args.mode_list:
        return rows, failed

    def sync():
        for d in devices:
            torch.cuda.synchronize(d)

    import inspect

    import torch.cuda.comm  # noqa: F401 - a submodule that `import torch` does not load

    # out= (preallocated outputs) exists in recent torch; older ones allocate every call.
    try:
        use_out = "out" in inspect.signature(torch.cuda.comm.broadcast).parameters
    except (TypeError, ValueError):
        use_out = False
    if not use_out:
        print("# torch-comm: this torch has no out= argument; outputs are allocated by "
              "every call")
    for nbytes, count in sizes:
        nsets = sets_for(nbytes, pool)
        try:
            srcs = [torch.zeros(nbytes, dtype=torch.uint8, device=root) for _ in range(nsets)]
            outs = [[torch.zeros(nbytes, dtype=torch.uint8, device=d) for d in others]
                    for _ in range(nsets)]
            srcs_t = [s.view(dtype) for s in srcs]
            outs_t = [[o.view(dtype) for o in os_] for os_ in outs]

            def op(i):
                if use_out:
                    torch.cuda.comm.broadcast(srcs_t[i], out=outs_t[i])
                else:
                    torch.cuda.comm.broadcast(srcs_t[i], devices)

            # Check once: pattern on the root, poison on the outputs.
            fill_pattern(torch, srcs[0], nbytes)
            for j, o in enumerate(outs[0]):
                o.fill_(0xA5 ^ (j + 1))
            sync()
            if use_out:
                op(0)
                sync()
                ok = all(matches_pattern(torch, o, nbytes) for o in outs[0])
            else:
                res = torch.cuda.comm.broadcast(srcs_t[0], devices)
                sync()
                ok = all(matches_pattern(torch, r.view(torch.uint8), nbytes) for r in res)
            if not ok:
                print(f"# torch-comm: VERIFY FAILED at {format_size(nbytes)}: outputs differ "
                      "from the root's data; size skipped")
                failed = True
                continue

            k = [0]

            def run(n):
                for j in range(n):
                    op((k[0] + j) % nsets)
                k[0] = (k[0] + n) % nsets

            def timed(n):
                sync()
                return event_span(torch, devices, run, n)

            run(3)
            sync()
            iters = pick_iters(args, timed)
            run(args.warmup if args.warmup is not None else min(iters, 50))
            samples = [timed(iters) / iters * 1e6 for _ in range(args.repeats)]
            rows.append(make_row(args, gpus, "eager", "torch-comm", nbytes, count, samples))
            r = rows[-1]
            print(f"# torch-comm eager {format_size(nbytes):>5}: {r['time_us']:10.2f} us "
                  f"{r['busbw_gbps']:8.2f} GB/s  ({iters} iters x {args.repeats}, {nsets} sets)",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the next size
            print(f"# torch-comm: {format_size(nbytes)} failed: {e!r}; skipped", flush=True)
        finally:
            srcs = outs = srcs_t = outs_t = None
            if nbytes >= 64 * MIB:
                torch.cuda.empty_cache()
    return rows, failed


# ----------------------------------------------------------------------------------------
# torch-dist and torch-symm: one process per GPU.


def _dist_worker(rank, cfg):
    """One rank, for torch-dist and/or torch-symm (--which). Rank 0 writes its rows to
    cfg['out'] (JSON) after every size."""
    import torch
    import torch.distributed as dist

    args = argparse.Namespace(**cfg["args"])
    world, root, pool = cfg["gpus"], args.root, cfg["pool"]
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    init = dict(backend="nccl", init_method=cfg["init"], rank=rank, world_size=world,
                timeout=timedelta(seconds=args.timeout_s))
    try:
        dist.init_process_group(device_id=dev, **init)
    except TypeError:  # torch without device_id
        dist.init_process_group(**init)
    rows = []
    state = {"failed": False}

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    def barrier():
        try:
            dist.barrier(device_ids=[rank])
        except TypeError:
            dist.barrier()

    def timed(run, n):
        torch.cuda.synchronize()
        barrier()
        torch.cuda.synchronize()
        span = event_span(torch, [rank], run, n)
        mine = torch.tensor([span], dtype=torch.float64, device=dev)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return float(torch.stack(every).max().item())

    def agree(ok):
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def save():
        if rank == 0:
            with open(cfg["out"], "w") as f:
                json.dump({"rows": rows, "failed": state["failed"]}, f)

    def capture(op, iters, nsets):
        """iters ops captured in one CUDA graph (after a warm-up on a side stream)."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for j in range(min(iters, 3)):
                op(j % nsets)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            ctx = torch.cuda.graph(graph, capture_error_mode="thread_local")
        except TypeError:  # older torch
            ctx = torch.cuda.graph(graph)
        with ctx:
            for j in range(iters):
                op(j % nsets)
        torch.cuda.synchronize()
        return graph

    def measure(name, op, nsets, nbytes, count, graph_ok):
        """Eager and graph rows of one size; returns whether graph mode still works."""
        k = [0]

        def run(n):
            for j in range(n):
                op((k[0] + j) % nsets)
            k[0] = (k[0] + n) % nsets

        run(3)
        torch.cuda.synchronize()
        iters = pick_iters(args, lambda n: timed(run, n))
        warm = args.warmup if args.warmup is not None else min(iters, 50)
        if "eager" in args.mode_list:
            run(warm)
            samples = [timed(run, iters) / iters * 1e6 for _ in range(args.repeats)]
            rows.append(make_row(args, world, "eager", name, nbytes, count, samples))
            r = rows[-1]
            log(f"# {name} eager {format_size(nbytes):>5}: {r['time_us']:10.2f} us "
                f"{r['busbw_gbps']:8.2f} GB/s  ({iters} iters x {args.repeats}, {nsets} sets)")
        if graph_ok:
            graph, err = None, None
            try:
                graph = capture(op, iters, nsets)
            except Exception as e:  # noqa: BLE001 - decided together below
                err = e
            if not agree(err is None):
                log(f"# {name}: graph capture failed ({err!r} on rank 0 or another "
                    "rank); graph mode skipped from here on")
                graph_ok = False
            else:
                def replay(n):
                    for _ in range(n):
                        graph.replay()

                replay(2)
                samples = [timed(replay, 1) / iters * 1e6 for _ in range(args.repeats)]
                rows.append(make_row(args, world, "graph", name, nbytes, count, samples))
                r = rows[-1]
                log(f"# {name} graph {format_size(nbytes):>5}: {r['time_us']:10.2f} us "
                    f"{r['busbw_gbps']:8.2f} GB/s  ({iters} ops per graph x {args.repeats})")
            del graph
        return graph_ok

    def run_dist_sizes(dtype, sizes):
        """torch-dist: torch.distributed.broadcast from the root, in place."""
        graph_ok = "graph" in args.mode_list
        for nbytes, count in sizes:
            nsets = sets_for(nbytes, pool)
            bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(nsets)]
            bufs_t = [b.view(dtype) for b in bufs]

            def op(i):
                dist.broadcast(bufs_t[i], src=root)

            # Check once: pattern on the root, poison elsewhere.
            if rank == root:
                fill_pattern(torch, bufs[0], nbytes)
            else:
                bufs[0].fill_(0xA5 ^ rank)
            torch.cuda.synchronize()
            op(0)
            torch.cuda.synchronize()
            if not agree(matches_pattern(torch, bufs[0], nbytes)):
                log(f"# torch-dist: VERIFY FAILED at {format_size(nbytes)}: a rank's buffer "
                    "differs from the root's data; size skipped")
                state["failed"] = True
                continue
            graph_ok = measure("torch-dist", op, nsets, nbytes, count, graph_ok)
            save()
            bufs = bufs_t = None
            if nbytes >= 64 * MIB:
                torch.cuda.empty_cache()

    def run_symm_sizes(dtype, sizes):
        """torch-symm: PyTorch's symmetric-memory one-shot all-reduce (torch.ops.symm_mem.
        one_shot_all_reduce, sum) standing in for a broadcast: the root's buffer holds the
        data, every other rank's is zero, so every rank gets the root's data; each rank reads
        every peer's buffer over NVLink (no multicast). Skipped, with the reason, when this
        torch lacks it or it does not run (it takes float32 and bfloat16)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group_name = dist.group.WORLD.group_name
            one_shot = torch.ops.symm_mem.one_shot_all_reduce
        except Exception as e:  # noqa: BLE001 - an older torch: report and skip
            log(f"# torch-symm: skipped: no symmetric-memory one-shot all-reduce in torch "
                f"{torch.__version__} ({e!r})")
            return
        try:
            one_shot_out = torch.ops.symm_mem.one_shot_all_reduce_out
        except Exception:  # noqa: BLE001 - older torch: the op allocates its output
            one_shot_out = None
        item = torch.empty(0, dtype=dtype).element_size()
        span = max(sets_for(nbytes, pool) * count for nbytes, count in sizes)
        err = None
        try:
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before torch 2.7, a no-op (or absent) after
                enable(group_name)
            if hasattr(symm_mem, "empty"):
                sbuf = symm_mem.empty(span, dtype=dtype, device=dev)
                symm_mem.rendezvous(sbuf, group_name)
            else:
                from torch._C._distributed_c10d import _SymmetricMemory

                sbuf = _SymmetricMemory.empty_strided_p2p(
                    size=(span,), stride=(1,), dtype=dtype, device=dev, group_name=group_name)
            sbuf.zero_()
            outs = torch.empty(span, dtype=dtype, device=dev)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - decided together below
            err = e
        if not agree(err is None):
            log(f"# torch-symm: skipped: symmetric memory could not be set up ({err!r} on "
                f"rank 0 or another rank; {span * item} bytes per rank)")
            return
        graph_ok = "graph" in args.mode_list
        for nbytes, count in sizes:
            nsets = sets_for(nbytes, pool)
            ins = [sbuf[i * count:(i + 1) * count] for i in range(nsets)]
            res = [outs[i * count:(i + 1) * count] for i in range(nsets)]

            def op(i):
                if one_shot_out is not None:
                    return one_shot_out(ins[i], "sum", group_name, res[i])
                return one_shot(ins[i], "sum", group_name)

            # Check once: small whole numbers on the root (exact in every float type, so
            # x + 0 is x bit for bit), zeros elsewhere, a poisoned output.
            err, ok = None, False
            try:
                want = ((torch.arange(count, dtype=torch.int64, device=dev) * 7 + nbytes)
                        % 251).to(dtype)
                if rank == root:
                    ins[0].copy_(want)
                else:
                    ins[0].zero_()
                res[0].fill_(-1)
                torch.cuda.synchronize()
                barrier()
                got = op(0)
                torch.cuda.synchronize()
                ok = torch.equal(got, want)
            except Exception as e:  # noqa: BLE001 - decided together below
                err = e
            if not agree(err is None):
                log(f"# torch-symm: {format_size(nbytes)} failed ({err!r} on rank 0 or another "
                    "rank); torch-symm skipped from here on")
                return
            if not agree(ok):
                log(f"# torch-symm: VERIFY FAILED at {format_size(nbytes)}: a rank's result "
                    "differs from the root's data; size skipped")
                state["failed"] = True
                continue
            # Rotating inputs keep the root's data in set 0 only; the op is timed the same
            # whatever the values.
            graph_ok = measure("torch-symm", op, nsets, nbytes, count, graph_ok)
            save()
            ins = res = None

    try:
        dtype, sizes = element_sizes(torch, args)
        if "dist" in cfg["which"]:
            run_dist_sizes(dtype, sizes)
        if "symm" in cfg["which"] and sizes:
            run_symm_sizes(dtype, sizes)
        save()
        torch.cuda.synchronize()
        barrier()
        code = 0
    except Exception:  # noqa: BLE001 - reported, and the exit code tells spawn
        print(f"# torch worker rank {rank} failed:\n{traceback.format_exc()}", flush=True)
        save()
        code = 1
    # Leave without tearing NCCL down: destroy_process_group (or the interpreter's own
    # teardown) was seen to hang after graphs had captured NCCL broadcasts (torch 2.11,
    # NCCL 2.28). The results are saved and the OS frees everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_dist(torch, args, gpus, pool, which):
    """torch-dist and/or torch-symm (`which`), in one set of spawned workers."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="gpucast-torch-dist-")
    out = os.path.join(tmp, "rows.json")
    cfg = {
        "args": dict(vars(args)),
        "gpus": gpus,
        "pool": pool,
        "init": "file://" + os.path.join(tmp, "rendezvous"),
        "out": out,
        "which": list(which),
    }
    failed = False
    try:
        mp.spawn(_dist_worker, args=(cfg,), nprocs=gpus, join=True)
    except Exception as e:  # noqa: BLE001 - keep what rank 0 saved
        print(f"# torch-dist: workers failed: {e}", flush=True)
    rows = []
    try:
        with open(out) as f:
            saved = json.load(f)
        rows, failed = saved["rows"], saved["failed"]
    except (OSError, ValueError, KeyError):
        print("# torch-dist: no results", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, failed


# ----------------------------------------------------------------------------------------


def print_table(rows):
    if not rows:
        print("# no rows")
        return
    keys = sorted({(r["mode"], r["path"]) for r in rows})
    sizes = sorted({r["bytes"] for r in rows})
    by = {(r["mode"], r["path"], r["bytes"]): r for r in rows}
    head = f"{'size':>6} " + "".join(f"{m + ' ' + p:>28}" for m, p in keys)
    print(head)
    print(f"{'':>6} " + "".join(f"{'time(us)  busbw(GB/s)':>28}" for _ in keys))
    for s in sizes:
        cells = []
        for m, p in keys:
            r = by.get((m, p, s))
            cells.append(f"{'-':>28}" if r is None
                         else f"{r['time_us']:>15.2f} {r['busbw_gbps']:>12.2f}")
        print(f"{format_size(s):>6} " + "".join(cells))


def write_csv(rows, path):
    order = {"eager": 0, "graph": 1}
    rows = sorted(rows, key=lambda r: (r["path"], order.get(r["mode"], 2), r["bytes"]))
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CSV_HEADER)
        for r in rows:
            # repr() of a float round-trips, and Rust's f64 parser reads it.
            w.writerow([repr(r[k]) if isinstance(r[k], float) else r[k] for k in CSV_HEADER])


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch_broadcast.py: PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("torch_broadcast.py: no CUDA device", file=sys.stderr)
        return 2
    visible = torch.cuda.device_count()
    gpus = visible if args.gpus is None else args.gpus
    if gpus < 2 or gpus > visible:
        print(f"torch_broadcast.py: need 2 <= --gpus <= {visible} (got {gpus})", file=sys.stderr)
        return 2
    if not 0 <= args.root < gpus:
        print(f"torch_broadcast.py: --root {args.root} is not among {gpus} GPUs", file=sys.stderr)
        return 2
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as e:  # noqa: BLE001
        nccl = f"unknown ({e!r})"
    print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")
    print(f"# GPUs: {gpus} of {visible} ({torch.cuda.get_device_name(0)}), root {args.root}, "
          f"dtype {DTYPES[args.dtype][1]}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    pool = args.pool_mb * MIB if args.pool_mb > 0 else max(512 * MIB, 2 * max(args.size_list))
    print(f"# sizes {format_size(min(args.size_list))}..{format_size(max(args.size_list))} "
          f"({len(args.size_list)}), repeats {args.repeats}, target {args.target_ms} ms per "
          f"repeat, rotation pool {format_size(pool)}", flush=True)

    start = time.perf_counter()
    rows, failed = [], False
    if "comm" in args.which_list:
        r, f = run_comm(torch, args, gpus, pool)
        rows += r
        failed |= f
        torch.cuda.empty_cache()
    dist_which = [w for w in args.which_list if w in ("dist", "symm")]
    if dist_which:
        r, f = run_dist(torch, args, gpus, pool, dist_which)
        rows += r
        failed |= f
    print_table(rows)
    if args.csv:
        write_csv(rows, args.csv)
        print(f"# wrote {len(rows)} rows to {args.csv}")
    print(f"# done in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    status = main()
    # Skip the interpreter's teardown: NCCL communicators cached by torch.cuda.comm may
    # block in their destructors, and the Rust bench waits for this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
