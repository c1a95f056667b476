#!/usr/bin/env python3
"""Times torch.nn.parallel.comm.broadcast_coalesced on the tensors of a .safetensors file.

The tensors are loaded on the root GPU; each repeat broadcasts all of them to every device
(PyTorch flattens them into buckets, broadcasts the buckets with NCCL and unflattens), with all
devices synchronised before and after. Prints `median_s <seconds>` for the caller.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("file")
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--root", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from torch.nn.parallel import comm

    devices = [int(d) for d in args.devices.split(",")]
    root_dev = devices[args.root]
    # The root must come first for broadcast_coalesced: it is the source device.
    order = [root_dev] + [d for d in devices if d != root_dev]
    tensors = list(load_file(args.file, device=f"cuda:{root_dev}").values())
    total = sum(t.numel() * t.element_size() for t in tensors)

    def sync():
        for d in order:
            torch.cuda.synchronize(d)

    out = comm.broadcast_coalesced(tensors, order)  # warm-up (NCCL init)
    for copies in out[1:]:
        for src, dst in zip(tensors, copies):
            assert torch.equal(src.cpu(), dst.cpu()), "broadcast_coalesced produced a wrong copy"
    del out
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        out = comm.broadcast_coalesced(tensors, order)
        sync()
        times.append(time.perf_counter() - t0)
        del out
    med = statistics.median(times)
    print(f"torch {torch.__version__}, {len(tensors)} tensors, {total / 1e9:.3f} GB, "
          f"{med * 1e3:.2f} ms = {total / med / 1e9:.1f} GB/s")
    print(f"median_s {med}")


if __name__ == "__main__":
    main()
