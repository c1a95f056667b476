"""A trainer pushes its weights to N inference workers after every step, as an RL loop does:
separately launched programs that join one gpucast group explicitly, one fused in-place call
for the whole state_dict (no packing buffer), every tensor checked bit for bit on every worker,
beside torch.distributed per tensor and packed into 1 GiB buckets (as vLLM does).

    python examples/python/rl_weight_sync.py                      # trainer + 2 workers
    python examples/python/rl_weight_sync.py --workers 3 --size 4G --steps 5
    python examples/python/rl_weight_sync.py --door torch         # the torch backend instead
    python examples/python/rl_weight_sync.py --mismatch           # a worker with another model

The launcher hands out a random token and a port, then starts the trainer with `python` and
the workers with `torchrun` (two launchers, two process trees; the workers are rank
1 + LOCAL_RANK). Or start them yourself, on any hosts that reach the trainer's address:

    GPUCAST_JOB_TOKEN=$T python rl_weight_sync.py trainer --addr HOST --port P --world 3
    GPUCAST_JOB_TOKEN=$T torchrun --nproc-per-node 2 rl_weight_sync.py worker --addr HOST --port P --world 3

With fewer GPUs than processes, every process uses GPU 0 (gpucast's shared-device mode: a
test mode whose figures are no link speeds). torch's NCCL cannot put two ranks on one GPU, so
the torch figures then come from gloo broadcasting the same CUDA tensors (through host memory),
and say so. Peak extra memory: torch.cuda.max_memory_allocated during the sync minus
memory_allocated before it, on each rank (gpucast's fixed buffers, set up once when the group
is created, are printed apart: the device's used memory before vs after creating it).

--mismatch: worker 1's model has one tensor of another shape; every process must get a
gpucast.MismatchError naming it within the timeout (exit status 0 when each did).
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
GiB = 1 << 30


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


# The model: bf16 transformer layers and fp32 norms, about --size bytes.
def layout(total_bytes, hidden=2048):
    import torch

    layer = [("attn.qkv", (3 * hidden, hidden), torch.bfloat16),
             ("attn.out", (hidden, hidden), torch.bfloat16),
             ("mlp.up", (4 * hidden, hidden), torch.bfloat16),
             ("mlp.down", (hidden, 4 * hidden), torch.bfloat16),
             ("norm1", (hidden,), torch.float32), ("norm2", (hidden,), torch.float32)]
    per_layer = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                    for _, s, d in layer)
    out = [("embed", (8192, hidden), torch.bfloat16)]
    for i in range(max(1, (total_bytes - 8192 * hidden * 2) // per_layer)):
        out += [(f"layers.{i}.{n}", s, d) for n, s, d in layer]
    return out


def as_ints(t):
    """The tensor's bits as integers of its element size (perturbed, compared)."""
    import torch

    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def expected(i, shape, dtype, step, device):
    """Tensor `i` of the trainer's model after `step` perturbations: random bits from its own
    seed, plus `step` (wrapping) in its integer view. Workers rebuild it one tensor at a time."""
    import torch

    g = torch.Generator(device=device).manual_seed(1000 + i)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)
    t = raw.view(dtype).view(shape)
    if step:
        as_ints(t).add_(step)
    return t


def tiny_barrier(comm, device):
    """Every rank has come: each rank broadcasts one byte in turn, then waits for it."""
    import torch

    b = torch.zeros(1, dtype=torch.uint8, device=device)
    for r in range(comm.world_size):
        comm.broadcast(b, r)
    torch.cuda.synchronize(device)


def packed_1gib(tensors, broadcast, device):
    """vLLM's way: consecutive tensors packed into a 1 GiB buffer, one broadcast per bucket,
    then unpacked (a tensor over 1 GiB goes alone)."""
    import torch

    import gpucast.weights

    buf = None
    for group in gpucast.weights.buckets(tensors, GiB):
        size = sum(t.numel() * t.element_size() for t in group)
        if buf is None or buf.numel() < size:
            buf = torch.empty(max(size, GiB if len(tensors) > 1 else size), dtype=torch.uint8,
                              device=device)
        off = 0
        for t in group:
            n = t.numel() * t.element_size()
            buf[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        broadcast(buf[:size])
        off = 0
        for t in group:
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(buf[off:off + n])
            off += n


def run_rank(role, args):
    import torch
    import torch.distributed as dist

    import gpucast

    os.environ.update(SAFE_ENV)
    rank = 0 if role == "trainer" else 1 + int(os.environ.get("LOCAL_RANK", "0"))
    world = args.world
    shared = torch.cuda.device_count() < world
    device = torch.device("cuda", 0 if shared else rank)
    torch.cuda.set_device(device)
    say = lambda msg: print(f"[{role} rank {rank}] {msg}", flush=True)  # noqa: E731

    lay = layout(parse_bytes(args.size))
    if args.mismatch and rank == 1:
        name, shape, dtype = lay[3]
        lay[3] = (name, (shape[0] + 1,) + tuple(shape[1:]), dtype)
    model = {name: expected(i, s, d, 0, device) if rank == 0 else
             torch.empty(s, dtype=d, device=device) for i, (name, s, d) in enumerate(lay)}
    tensors = list(model.values())
    total = sum(t.numel() * t.element_size() for t in tensors)

    free0 = torch.cuda.mem_get_info(device)[0]
    if args.door == "explicit":
        comm = gpucast.Communicator(rank=rank, world_size=world, master_addr=args.addr,
                                    master_port=args.port, device=device.index,
                                    shared_devices=shared, timeout=args.timeout)
        sync = lambda check=True: gpucast.broadcast_state_dict(comm, model, 0, check=check)  # noqa: E731,E501
    else:
        import gpucast.torch as gt

        gt.configure(timeout=args.timeout)
        dist.init_process_group("gpucast", init_method=f"tcp://{args.addr}:{args.port}",
                                rank=rank, world_size=world)
        comm = gt.communicator()
        sync = lambda check=True: gt.broadcast_coalesced(model, src=0, check=check)  # noqa: E731,E501
    torch.cuda.synchronize(device)
    fixed = free0 - torch.cuda.mem_get_info(device)[0]
    # On a shared GPU the other ranks allocate at the same time: no figure of this rank's own.
    taken = ("not measurable (the GPU is shared with the other ranks)" if shared else
             f"{fixed / 2**20:.0f} MiB")
    say(f"joined the group ({args.door}) on GPU {device.index}"
        f"{' (shared)' if shared else ''}; device memory taken by creating it: {taken}")

    if args.mismatch:
        try:
            t0 = time.perf_counter()
            sync()
            torch.cuda.synchronize(device)
        except gpucast.MismatchError as e:
            took = time.perf_counter() - t0
            ok = lay[3][0] in str(e)
            say(f"MismatchError after {took:.2f} s{'' if ok else ' NOT NAMING ' + lay[3][0]}: {e}")
            sys.exit(0 if ok and took < args.timeout * (world + 3) else 1)
        say("no MismatchError: the mismatch went unnoticed")
        sys.exit(1)

    # The torch.distributed baseline: NCCL with one GPU per process, else gloo.
    base_backend = "gloo" if shared else "nccl"
    if args.door == "explicit":
        dist.init_process_group(base_backend, init_method=f"tcp://{args.addr}:{args.port + 1}",
                                rank=rank, world_size=world)
        base = None
    else:
        base = dist.new_group(list(range(world)), backend=base_backend)
    methods = [("gpucast, one fused call, checked", lambda: sync(True)),
               (f"torch.distributed ({base_backend}) per tensor",
                lambda: [dist.broadcast(t, 0, group=base) for t in tensors]),
               (f"torch.distributed ({base_backend}) packed 1 GiB",
                lambda: packed_1gib(tensors, lambda b: dist.broadcast(b, 0, group=base),
                                    device))]
    if args.no_torch:
        methods = methods[:1]
    times = {m: [] for m, _ in methods}
    extra = {m: 0 for m, _ in methods}
    for step in range(1, args.steps + 1):
        if rank == 0:
            for t in tensors:
                as_ints(t).add_(1)  # the step's update: every element changes
        for name, fn in methods:
            if rank != 0:
                for t in tensors:
                    t.view(torch.uint8).fill_(0xA5)  # stale weights, so each method must deliver
            tiny_barrier(comm, device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
            extra[name] = max(extra[name], torch.cuda.max_memory_allocated(device) - before)
            if rank != 0:
                for i, (k, s, d) in enumerate(lay):
                    want = expected(i, s, d, step, device)
                    if not torch.equal(as_ints(model[k]), as_ints(want)):
                        say(f"step {step}, {name}: tensor {k} differs from the trainer's")
                        sys.exit(1)
    say(f"{len(tensors)} tensors, {total / 1e9:.3f} GB, {args.steps} steps, every tensor "
        f"checked bit for bit " + ("on this worker after every sync" if rank else
                                   "by each worker (see their lines)"))
    for name, ts in times.items():
        s = statistics.median(ts)
        say(f"  {name:<44} {s * 1e3:9.1f} ms/sync  {total / s / 1e9:7.2f} GB/s  peak extra "
            f"{extra[name] / 2**20:8.1f} MiB ({100 * extra[name] / total:.2f}% of the model)")
    if shared:
        say("  (all processes share GPU 0: these are no link speeds; torch's NCCL cannot run "
            "two ranks on one GPU, so torch's figures are gloo's on the same CUDA tensors)")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    import gpucast

    env = dict(os.environ, **SAFE_ENV, GPUCAST_JOB_TOKEN=gpucast.random_token())
    port = free_port()
    world = 1 + args.workers
    common = ["--addr", "127.0.0.1", "--port", str(port), "--world", str(world),
              "--size", args.size, "--steps", str(args.steps), "--door", args.door,
              "--timeout", str(args.timeout)] + (["--mismatch"] if args.mismatch else []) + \
             (["--no-torch"] if args.no_torch else [])
    me = os.path.abspath(__file__)
    trainer = subprocess.Popen([sys.executable, me, "trainer"] + common, env=env)
    workers = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(args.workers), me, "worker"] + common,
                               env=env)
    limit = 600
    rcs = []
    for p in (trainer, workers):
        try:
            rcs.append(p.wait(timeout=limit))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append("timeout")
    print(f"trainer exit {rcs[0]}, workers exit {rcs[1]}")
    sys.exit(0 if rcs == [0, 0] else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", choices=["trainer", "worker"],
                    help="this process's role (default: launch a trainer and the workers)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--world", type=int, help="trainer + workers (set by the launcher)")
    ap.add_argument("--addr", default="127.0.0.1", help="the trainer's address")
    ap.add_argument("--port", type=int, help="the group's port (the next one: torch's)")
    ap.add_argument("--size", default="1G", help="model bytes (default 1G)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--door", choices=["explicit", "torch"], default="explicit",
                    help="gpucast.Communicator(rank=...) or the torch backend \"gpucast\"")
    ap.add_argument("--timeout", type=float, default=20.0, help="gpucast's bound per wait")
    ap.add_argument("--mismatch", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed's figures")
    args = ap.parse_args()
    if args.role is None:
        launch(args)
    else:
        if args.world is None or args.port is None:
            ap.error("a trainer or worker needs --world and --port")
        run_rank(args.role, args)


if __name__ == "__main__":
    main()
