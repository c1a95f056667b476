"""One rank of the multi-process tests (run by test_gpu.py, one process per rank, all on
GPU 0 in gpucast's shared-device mode). Prints `ok <case>` and exits 0 when every check held;
any failure is an exception (exit 1) with its message on stderr."""

import os
import sys
import time

import torch

import gpucast

CASE = os.environ["CASE"]
SEED = int(os.environ.get("SEED", "7"))
DEVICE = int(os.environ.get("TEST_DEVICE", "0"))


def data(i, n, dtype, device):
    """Tensor `i` of the test: random bits the root and every checker derive alike."""
    g = torch.Generator().manual_seed(SEED * 1000 + i)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device)


def poisoned(n, dtype, device):
    t = torch.empty(n, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xA5)
    return t


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main():
    torch.cuda.set_device(DEVICE)
    comm = gpucast.Communicator.from_env(
        device=DEVICE, shared_devices=True, timeout=float(os.environ.get("TIMEOUT_S", "10")))
    dev = f"cuda:{DEVICE}"
    rank, world = comm.rank, comm.world_size
    assert world == int(os.environ["WORLD_SIZE"])
    if CASE == "broadcast":
        dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                  torch.uint8, torch.int32, torch.uint32, torch.int64, torch.uint64,
                  torch.bool, torch.complex64]
        sizes = [0, 3, 4097, (1 << 20) + 5]
        i = 0
        for src in sorted({0, world - 1}):
            for dtype in dtypes:
                for n in sizes:
                    for path in [None] + (["p2p"] if dtype == torch.float32 else []):
                        expected = data(i, n, dtype, dev)
                        t = expected.clone() if rank == src else poisoned(n, dtype, dev)
                        comm.broadcast(t, src=src, path=path)
                        assert same_bits(t, expected), (src, dtype, n, path)
                        i += 1
        # A side stream: the write, held back, must land before the broadcast reads it, and
        # the read on that stream after the call must see its result.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            n = 1 << 22
            expected = data(99, n, torch.int32, dev)
            t = poisoned(n, torch.int32, dev)
            torch.cuda._sleep(50_000_000)
            if rank == 0:
                t.copy_(expected)
            comm.broadcast(t, src=0)
            got = t.clone()
        side.synchronize()
        assert same_bits(got, expected), "side stream"
        comm.synchronize()
    elif CASE == "many":
        dtypes = [torch.bfloat16, torch.float32, torch.int64, torch.uint8]
        shapes = [(i * 37 % 300 + 1,) for i in range(200)] + [(1024, 1024), (3, 5, 7), (0,)]
        expected = [data(i, int(torch.tensor(s).prod()), dtypes[i % 4], dev).view(s)
                    for i, s in enumerate(shapes)]
        tensors = [e.clone() if rank == 0 else poisoned(e.numel(), e.dtype, dev).view(e.shape)
                   for e in expected]
        comm.broadcast_many(tensors, src=0)
        for k, (t, e) in enumerate(zip(tensors, expected)):
            assert same_bits(t, e), k
        # Dropped at once: the inputs go out of scope right after the call.
        for rnd in range(5):
            ts = [data(1000 + rnd * 10 + k, 1 << 16, torch.float32, dev) if rank == 0
                  else torch.empty(1 << 16, device=dev) for k in range(4)]
            comm.broadcast_many(ts, src=0)
            if rank != 0:
                outs = [t.clone() for t in ts]
                del ts
                for k, o in enumerate(outs):
                    assert same_bits(o, data(1000 + rnd * 10 + k, 1 << 16, torch.float32, dev))
            else:
                del ts
        comm.synchronize()
    elif CASE == "absent-peer":
        # Rank 1 never sends: rank 0, waiting for its message, gets an error within the
        # timeout, never a hang.
        if rank == 0:
            t = torch.ones(1 << 10, device=dev)
            start = time.monotonic()
            try:
                comm.broadcast(t, src=1, path="p2p")
                comm.synchronize()
                raise AssertionError("no error")
            except gpucast.TimeoutError as e:
                took = time.monotonic() - start
                assert took < float(os.environ.get("TIMEOUT_S", "10")) + 10, took
                print(f"timeout after {took:.1f} s: {e}", file=sys.stderr)
        else:
            time.sleep(float(os.environ.get("TIMEOUT_S", "10")) + 3)
    elif CASE == "mismatch":
        # Ranks disagree on the size: every rank gets an error within the timeout.
        n = 4096 if rank == 0 else 8192
        t = torch.zeros(n, device=dev)
        start = time.monotonic()
        try:
            comm.broadcast(t, src=0, path="p2p")
            comm.synchronize()
            raise AssertionError("no error")
        except gpucast.Error as e:
            took = time.monotonic() - start
            print(f"{type(e).__name__} after {took:.1f} s: {e}", file=sys.stderr)
            assert took < float(os.environ.get("TIMEOUT_S", "10")) + 10, took
            if os.environ.get("EXPECT_MISMATCH"):
                assert isinstance(e, gpucast.ArgumentError) or "differ" in str(e), e
    else:
        raise SystemExit(f"unknown case {CASE}")
    print(f"ok {CASE} rank {rank}")


if __name__ == "__main__":
    main()
