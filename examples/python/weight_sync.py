"""Send a model's weights from rank 0 to every rank, as a trainer pushes weights to its
inference workers after each step: one fused gpucast call per bucket, every tensor checked bit
for bit, GB/s printed beside torch.distributed's per-tensor and bucketed broadcasts.

    torchrun --standalone --nproc-per-node 2 examples/python/weight_sync.py
    torchrun --standalone --nproc-per-node 2 examples/python/weight_sync.py --model model.safetensors
    # one GPU: every rank on GPU 0 (gpucast's test mode; torch.distributed is skipped)
    torchrun --standalone --nproc-per-node 2 examples/python/weight_sync.py --shared

The weights: a .safetensors file (--model, every rank reads its header; rank 0 its tensors),
else synthetic bf16 layers of a transformer (--size bytes in all).
"""

import argparse
import os
import time

import torch

import gpucast


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def synthetic_layout(total_bytes, hidden=4096):
    """(name, shape, dtype) of bf16 transformer layers adding up to about `total_bytes`."""
    layer = [("attn.qkv", (3 * hidden, hidden)), ("attn.out", (hidden, hidden)),
             ("mlp.up", (4 * hidden, hidden)), ("mlp.down", (hidden, 4 * hidden)),
             ("norm1", (hidden,)), ("norm2", (hidden,))]
    per_layer = sum(torch.Size(s).numel() for _, s in layer) * 2
    n_layers = max(1, total_bytes // per_layer)
    out = [("embed", (32000 if total_bytes >= 1 << 30 else 1024, hidden), torch.bfloat16)]
    for i in range(n_layers):
        out += [(f"layers.{i}.{name}", shape, torch.bfloat16) for name, shape in layer]
    return out


def synthetic_values(layout, device, seed=1234):
    """The synthetic weights, the same on every rank that builds them (random bits)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape, dtype in layout:
        raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device,
                            generator=g)
        out[name] = raw.view(dtype)
    return out


def safetensors_layout(path):
    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
             "U8": torch.uint8, "BOOL": torch.bool}
    with safe_open(path, framework="pt") as f:
        return [(k, tuple(f.get_slice(k).get_shape()), names[f.get_slice(k).get_dtype()])
                for k in f.keys()]


def timed(fn, iters):
    """Seconds per call of `fn`, by CUDA events on the current stream, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a .safetensors file (default: synthetic bf16 layers)")
    ap.add_argument("--size", default="1G", help="synthetic weights in bytes (default 1G)")
    ap.add_argument("--bucket", default="256M", help="bytes per fused call (default 256M)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--shared", action="store_true",
                    help="every rank on GPU 0 (gpucast's test mode; no torch.distributed)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed's figures")
    args = ap.parse_args()
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(k, v)

    device = 0 if args.shared else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)
    comm = gpucast.Communicator.from_env(device=device, shared_devices=args.shared)
    rank, world = comm.rank, comm.world_size
    dev = f"cuda:{device}"

    # Rank 0 holds the weights; the others allocate the same shapes and receive them.
    if args.model:
        layout = safetensors_layout(args.model)
        if rank == 0:
            from safetensors.torch import load_file

            weights = load_file(args.model, device=dev)
        else:
            weights = {k: torch.empty(s, dtype=d, device=dev) for k, s, d in layout}
    else:
        layout = synthetic_layout(parse_bytes(args.size))
        if rank == 0:
            weights = synthetic_values(layout, dev)
        else:
            weights = {k: torch.empty(s, dtype=d, device=dev) for k, s, d in layout}
    tensors = [weights[k] for k, _, _ in layout]
    total = sum(t.numel() * t.element_size() for t in tensors)
    groups = gpucast.weights.buckets(tensors, parse_bytes(args.bucket))

    def gpucast_sync():
        for group in groups:
            comm.broadcast_many(group, src=0)

    # The check: every tensor bit for bit against the root's (regenerated or reloaded here).
    gpucast_sync()
    if rank != 0:
        if args.model:
            from safetensors.torch import load_file

            expected = load_file(args.model, device=dev)
        else:
            expected = synthetic_values(layout, dev)
        bad = [k for k, _, _ in layout
               if not torch.equal(weights[k].view(torch.uint8), expected[k].view(torch.uint8))]
        assert not bad, f"rank {rank}: {len(bad)} tensors differ, first {bad[0]}"
        del expected
    comm.synchronize()

    rows = [("gpucast, one fused call per bucket", timed(gpucast_sync, args.iters))]
    distinct = not args.shared and torch.cuda.device_count() >= world
    if distinct and not args.no_torch:
        import torch.distributed as dist

        dist.init_process_group("nccl", device_id=torch.device(dev))

        def per_tensor():
            for t in tensors:
                dist.broadcast(t, src=0)

        def bucketed():
            for group in groups:
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in group])
                dist.broadcast(flat, src=0)
                off = 0
                for t in group:
                    n = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(flat[off:off + n])
                    off += n

        rows.append(("torch.distributed.broadcast per tensor", timed(per_tensor, args.iters)))
        rows.append(("torch.distributed.broadcast bucketed", timed(bucketed, args.iters)))
        dist.destroy_process_group()
    if rank == 0:
        print(f"{len(tensors)} tensors, {total / 1e9:.3f} GB, {len(groups)} buckets, "
              f"{world} ranks ({'all on GPU 0' if args.shared else 'one GPU each'}); "
              f"every tensor checked bit for bit on every rank")
        for name, s in rows:
            print(f"  {name:<42} {s * 1e3:9.2f} ms  {total / s / 1e9:8.1f} GB/s")
        if not distinct:
            print("  torch.distributed: skipped (it needs one GPU per process)")
    time.sleep(0.1)


if __name__ == "__main__":
    main()
