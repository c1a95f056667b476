"""One rank of the CPU test of the "gpucast" backend's torch side (test_torch_cpu.py): torch's
own init_process_group, new_group, broadcast, broadcast_object_list, barrier, coalescing
manager and refusals, run through gpucast.torch's process group with a stand-in communicator
that carries CPU tensors over torch's store (no GPU here). Prints `ok rank <r>`."""

import os
import sys
import time

import torch
import torch.distributed as dist

import gpucast
import gpucast.torch as gt

RANK, WORLD, PORT = (int(os.environ[k]) for k in ["RANK_ARG", "WORLD_ARG", "PORT_ARG"])


class StoreComm:
    """Broadcasts of CPU tensors through a torch store: the stand-in for gpucast's engine."""

    def __init__(self, store, rank, size):
        self.store, self.rank, self.world_size, self.device = store, rank, size, "cpu"
        self.round = 0
        self.calls = []

    def broadcast_many(self, tensors, src):
        k, self.round = self.round, self.round + 1
        self.calls.append((len(tensors), src))
        if self.rank == src:
            self.store.set(f"fake/{k}", b"".join(
                bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist()) for t in tensors))
        else:
            self.store.wait([f"fake/{k}"])
            data = self.store.get(f"fake/{k}")
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.view(torch.uint8).reshape(-1).copy_(
                    torch.tensor(list(data[off:off + n]), dtype=torch.uint8))
                off += n

    def broadcast(self, t, src=0):
        self.broadcast_many([t], src)

    def synchronize(self):
        pass


made = []


def stand_in(store, rank, size, timeout, settings):
    # The real creator's meeting still runs: the store all-gather of the hosts and devices.
    keys = gt._StoreGather(store, rank, size, timeout)(f"rank {rank}".encode())
    assert keys == [f"rank {r}".encode() for r in range(size)], keys
    made.append(StoreComm(store, rank, size))
    return made[-1]


gt._communicator = stand_in
dist.init_process_group("gpucast", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                        world_size=WORLD)
assert dist.get_backend() == "gpucast"
assert isinstance(dist.distributed_c10d._get_default_group(), gt.ProcessGroupGpucast)
comm = made[0]

# dist.broadcast, two roots; async_op's work.
for src in range(WORLD):
    t = torch.arange(10, dtype=torch.float32) * (src + 1) if RANK == src else torch.zeros(10)
    dist.broadcast(t, src=src)
    assert torch.equal(t, torch.arange(10, dtype=torch.float32) * (src + 1)), t
w = dist.broadcast(t, src=0, async_op=True)
assert w.wait() and w.is_completed()
assert comm.calls[-1] == (1, 0)

# Objects go through broadcast.
before = len(comm.calls)
objs = [{"step": 7}, "x"] if RANK == 1 else [None, None]
dist.broadcast_object_list(objs, src=1)
assert objs == [{"step": 7}, "x"], objs
assert len(comm.calls) > before

# The barrier waits for the last rank to come.
if RANK == WORLD - 1:
    time.sleep(1.0)
start = time.monotonic()
dist.barrier()
if RANK == 0:
    assert time.monotonic() - start > 0.5, "the barrier did not wait for the last rank"

# One fused call: the documented one (with the layout check), and torch's coalescing manager.
sd = {"a": torch.full((3,), 1.5) if RANK == 0 else torch.zeros(3),
      "b": torch.arange(4) if RANK == 0 else torch.zeros(4, dtype=torch.int64)}
gt.broadcast_coalesced(sd, src=0, check=True)
assert torch.equal(sd["a"], torch.full((3,), 1.5)) and torch.equal(sd["b"], torch.arange(4))
assert comm.calls[-1] == (2, 0)
ts = [torch.full((5,), 9.0) if RANK == 0 else torch.zeros(5) for _ in range(3)]
before = len(comm.calls)
with dist._coalescing_manager(device=torch.device("cpu")):
    for t in ts:
        dist.broadcast(t, src=0)
assert comm.calls[before:] == [(3, 0)], comm.calls[before:]
assert all(torch.equal(t, torch.full((5,), 9.0)) for t in ts)

# A mismatch is an error on every rank, naming the tensor.
bad = dict(sd)
if RANK == WORLD - 1:
    bad["b"] = torch.zeros(5, dtype=torch.int64)
try:
    gt.broadcast_coalesced(bad, src=0, check=True)
    raise AssertionError("no MismatchError")
except gpucast.MismatchError as e:
    assert "'b'" in str(e), e

# A sub-group of the backend.
sub = dist.new_group(list(range(WORLD)), backend="gpucast")
assert isinstance(sub, gt.ProcessGroupGpucast) and len(made) == 2
t = torch.ones(2) if RANK == 0 else torch.zeros(2)
dist.broadcast(t, src=0, group=sub)
assert torch.equal(t, torch.ones(2)) and made[1].calls == [(1, 0)]

# Everything else is refused through torch's own API.
for name, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(2))),
                   ("all_gather", lambda: dist.all_gather([torch.ones(2)] * WORLD,
                                                          torch.ones(2))),
                   ("reduce_scatter_tensor",
                    lambda: dist.reduce_scatter_tensor(torch.ones(2), torch.ones(2 * WORLD))),
                   ("send", lambda: dist.send(torch.ones(2), dst=(RANK + 1) % WORLD))]:
    try:
        call()
        raise AssertionError(f"{name} not refused")
    except NotImplementedError as e:
        assert name in str(e) and 'backend="nccl"' in str(e), e
dist.barrier()
dist.destroy_process_group()
print(f"ok rank {RANK}")
sys.stdout.flush()
