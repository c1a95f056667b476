"""One rank of the explicit-group and torch-backend tests (run by test_groups_gpu.py, one
process per rank, all on GPU 0). Reads CASE, RANK, WORLD, PORT (and TIMEOUT_S) from the
environment and none of torchrun's variables; prints `ok <case> rank <r>` and exits 0 when
every check held."""

import os
import sys
import time

import torch
import torch.distributed as dist

import gpucast

CASE = os.environ["CASE"]
RANK = int(os.environ["RANK_ARG"])
WORLD = int(os.environ["WORLD_ARG"])
PORT = int(os.environ["PORT_ARG"])
TIMEOUT = float(os.environ.get("TIMEOUT_S", "10"))
DEV = torch.device("cuda", 0)


def data(i, n, dtype):
    g = torch.Generator().manual_seed(4242 + i)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(DEV)


def poisoned(n, dtype):
    t = torch.empty(n, dtype=dtype, device=DEV)
    t.view(torch.uint8).fill_(0xA5)
    return t


def same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def model(rank, variant=None):
    """A small state_dict; `variant` changes one thing on this rank."""
    layout = [("embed.weight", (64, 32), torch.bfloat16), ("a.weight", (32, 32), torch.float32),
              ("a.bias", (32,), torch.float32), ("b.weight", (128, 32), torch.float16),
              ("b.steps", (1,), torch.int64)]
    if variant == "shape":
        layout[3] = ("b.weight", (129, 32), torch.float16)
    elif variant == "dtype":
        layout[1] = ("a.weight", (32, 32), torch.bfloat16)
    elif variant == "count":
        layout = layout[:-1]
    out = {}
    for i, (name, shape, dtype) in enumerate(layout):
        n = torch.Size(shape).numel()
        out[name] = (data(i, n, dtype) if rank == 0 else poisoned(n, dtype)).view(shape)
    return out


def check_model(m):
    for i, (name, t) in enumerate(m.items()):
        assert same(t, data(i, t.numel(), t.dtype).view(t.shape)), name


def expect_mismatch(fn, naming):
    start = time.monotonic()
    try:
        fn()
        torch.cuda.synchronize()
    except gpucast.MismatchError as e:
        took = time.monotonic() - start
        assert naming in str(e), (naming, str(e))
        assert took < TIMEOUT * (WORLD + 2), took
        print(f"rank {RANK}: MismatchError after {took:.2f} s: {e}", file=sys.stderr)
        return
    raise AssertionError(f"rank {RANK}: no MismatchError")


def explicit(variant_rank=None, variant=None, naming=None):
    torch.cuda.set_device(DEV)
    comm = gpucast.Communicator(rank=RANK, world_size=WORLD, master_addr="127.0.0.1",
                                master_port=PORT, token=os.environ["TOKEN_ARG"], device=0,
                                shared_devices=True, timeout=TIMEOUT)
    assert (comm.rank, comm.world_size, comm.device) == (RANK, WORLD, 0)
    m = model(RANK, variant if RANK == variant_rank else None)
    if variant is None:
        gpucast.broadcast_state_dict(comm, m, src=0)
        if RANK:
            check_model(m)
        # Another source, one tensor.
        x = data(77, 5000, torch.int32) if RANK == WORLD - 1 else poisoned(5000, torch.int32)
        comm.broadcast(x, src=WORLD - 1)
        assert same(x, data(77, 5000, torch.int32))
        comm.synchronize()
    else:
        expect_mismatch(lambda: gpucast.broadcast_state_dict(comm, m, src=0), naming)


def backend(variant=None):
    import gpucast.torch as gt

    torch.cuda.set_device(DEV)
    gt.configure(timeout=TIMEOUT)
    dist.init_process_group("gpucast", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                            world_size=WORLD)
    assert dist.get_backend() == "gpucast"
    if variant == "mismatch":
        m = model(RANK, "shape" if RANK == WORLD - 1 else None)
        expect_mismatch(lambda: gt.broadcast_coalesced(m, src=0, check=True), "b.weight")
        dist.destroy_process_group()
        return
    # dist.broadcast: every dtype, two roots.
    i = 0
    for src in sorted({0, WORLD - 1}):
        for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                      torch.complex64]:
            for n in [1, 4097, (1 << 20) + 3]:
                want = data(i, n, dtype)
                t = want.clone() if RANK == src else poisoned(n, dtype)
                dist.broadcast(t, src=src)
                assert same(t, want), (src, dtype, n)
                i += 1
    # async_op: the work's wait orders the current stream, as NCCL's.
    want = data(500, 1 << 16, torch.float32)
    t = want.clone() if RANK == 0 else poisoned(1 << 16, torch.float32)
    dist.broadcast(t, src=0, async_op=True).wait()
    assert same(t, want)
    # Objects, through broadcast.
    objs = [{"step": 3, "lr": 0.5}, "text", None] if RANK == 1 else [None, None, None]
    dist.broadcast_object_list(objs, src=1)
    assert objs == [{"step": 3, "lr": 0.5}, "text", None], objs
    dist.barrier()
    # A fused broadcast: the documented call, and torch's coalescing manager.
    m = model(RANK)
    gt.broadcast_coalesced(m, src=0, check=True)
    if RANK:
        check_model(m)
    m = model(RANK)
    with dist._coalescing_manager(device=DEV):
        for t in m.values():
            dist.broadcast(t, src=0)
    if RANK:
        check_model(m)
    # A sub-group of the gpucast backend: ranks 0 and WORLD-1 (the others are not members).
    sub = dist.new_group([0, WORLD - 1], backend="gpucast")
    if RANK in (0, WORLD - 1):
        want = data(900, 3000, torch.float16)
        t = want.clone() if RANK == WORLD - 1 else poisoned(3000, torch.float16)
        dist.broadcast(t, src=WORLD - 1, group=sub)
        assert same(t, want)
        gt.communicator(sub).synchronize()
    # Everything else: refused, naming what to use.
    for call in [lambda: dist.all_reduce(torch.ones(4, device=DEV)),
                 lambda: dist.all_gather([torch.ones(4, device=DEV)] * WORLD,
                                         torch.ones(4, device=DEV)),
                 lambda: dist.send(torch.ones(4, device=DEV), dst=(RANK + 1) % WORLD)]:
        try:
            call()
            raise AssertionError("not refused")
        except NotImplementedError as e:
            assert "nccl" in str(e), e
    dist.barrier()
    dist.destroy_process_group()


def main():
    if CASE == "explicit":
        explicit()
    elif CASE.startswith("explicit-"):
        variant = CASE.split("-", 1)[1]
        naming = {"shape": "b.weight", "dtype": "a.weight", "count": "b.steps"}[variant]
        explicit(variant_rank=WORLD - 1, variant=variant, naming=naming)
    elif CASE == "backend":
        backend()
    elif CASE == "backend-mismatch":
        backend("mismatch")
    else:
        raise SystemExit(f"unknown case {CASE}")
    print(f"ok {CASE} rank {RANK}")


if __name__ == "__main__":
    main()
