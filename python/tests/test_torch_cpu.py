"""The torch side without a GPU: the "gpucast" backend's registration, its refusals, the
store all-gather its groups meet through, and the state_dict check's protocol (ranks as
threads over an in-memory transport). Needs torch: skipped without it, except where
GPUCAST_REQUIRE_TORCH=1 (CI), where a missing torch fails."""

import datetime
import os
import threading

import pytest

if os.environ.get("GPUCAST_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401  (CI installs it: a missing torch must fail, not skip)
else:
    torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gpucast  # noqa: E402
import gpucast.torch as gt  # noqa: E402


def test_importing_gpucast_torch_registers_the_backend_once():
    assert dist.Backend.GPUCAST == "gpucast"
    assert dist.Backend("gpucast") == "gpucast"
    assert dist.Backend.backend_list.count("gpucast") == 1
    assert dist.Backend.backend_capability["gpucast"] == ["cuda"]
    assert "GPUCAST" in dist.Backend._plugins
    import importlib

    importlib.reload(gt)  # a second import registers nothing twice
    assert dist.Backend.backend_list.count("gpucast") == 1


def test_every_other_collective_is_refused_naming_the_backend_to_use():
    pg = gt.ProcessGroupGpucast(0, 2, None)
    assert pg.getBackendName() == "gpucast"
    assert isinstance(pg, dist.ProcessGroup)
    t = torch.zeros(4)
    for name in gt.REFUSED:
        with pytest.raises(NotImplementedError) as e:
            getattr(pg, name)([t], None)
        msg = str(e.value)
        assert "gpucast backend only broadcasts" in msg, name
        if name != "monitored_barrier":
            assert 'backend="nccl"' in msg and "gloo" in msg, name
    # The ones it serves are not refused.
    for name in ["broadcast", "barrier", "broadcast_coalesced", "_start_coalescing",
                 "_end_coalescing"]:
        assert getattr(gt.ProcessGroupGpucast, name) is not getattr(dist.ProcessGroup, name,
                                                                     None), name


def test_settings_are_checked_and_a_foreign_group_is_refused():
    with pytest.raises(TypeError, match="unknown settings"):
        gt.configure(timeout=3.0, warp=9)
    gt.configure()
    with pytest.raises(TypeError, match="not a group of the gpucast backend"):
        gt.broadcast_coalesced([torch.zeros(1)], group=object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_init_process_group_without_a_gpu_is_an_error_not_a_hang():
    store = dist.HashStore()
    with pytest.raises(gpucast.UnavailableError, match="CUDA"):
        dist.init_process_group("gpucast", store=store, rank=0, world_size=1)
    assert not dist.is_initialized()


def ranks_as_threads(world, fn):
    """Runs fn(rank) on `world` threads; returns results or raises the first exception."""
    out, errs = [None] * world, [None] * world

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    return out, errs


def test_the_store_all_gather_returns_every_rank_s_bytes_in_order_round_by_round():
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=10)

    def rank(r):
        g = gt._StoreGather(store, r, 3, timeout)
        return [g(f"r{r} first".encode()), g(b"x" * r)]

    out, errs = ranks_as_threads(3, rank)
    assert errs == [None] * 3
    for r in range(3):
        assert out[r][0] == [b"r0 first", b"r1 first", b"r2 first"]
        assert out[r][1] == [b"", b"x", b"xx"]


def test_the_store_all_gather_of_an_absent_rank_is_bounded():
    store = dist.HashStore()
    g = gt._StoreGather(store, 0, 2, datetime.timedelta(seconds=1))
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        g(b"alone")


class ThreadComm:
    """`world` ranks as threads whose broadcast_many copies the root's CPU tensors into the
    others' (an in-memory transport, to test the check's protocol without a GPU)."""

    def __init__(self, shared, rank, world):
        self.shared, self.rank, self.world_size, self.device = shared, rank, world, "cpu"

    def broadcast_many(self, tensors, src):
        s = self.shared
        with s["cv"]:
            n = s["round"][self.rank]
            s["round"][self.rank] += 1
            if self.rank == src:
                s["posted"][n] = [t.clone() for t in tensors]
                s["cv"].notify_all()
            else:
                assert s["cv"].wait_for(lambda: n in s["posted"], 10), "root never posted"
                for t, v in zip(tensors, s["posted"][n]):
                    t.copy_(v)


def check_with(world, layouts):
    shared = {"cv": threading.Condition(), "round": [0] * world, "posted": {}}

    def rank(r):
        named = [(n, torch.zeros(s, dtype=d)) for n, s, d in layouts[r]]
        gpucast.check_layout(ThreadComm(shared, r, world), named, src=0)

    return ranks_as_threads(world, rank)[1]


BASE = [("a.weight", (4, 4), torch.float32), ("a.bias", (4,), torch.float32),
        ("b.weight", (8, 4), torch.bfloat16)]


def test_the_state_dict_check_passes_identical_layouts():
    assert check_with(3, [BASE] * 3) == [None] * 3


@pytest.mark.parametrize("other, naming, detail", [
    ([BASE[0], ("a.bias", (5,), torch.float32), BASE[2]], "a.bias", "(5,)"),
    ([BASE[0], BASE[1], ("b.weight", (8, 4), torch.float16)], "b.weight", "torch.float16"),
    (BASE[:2], "b.weight", "2 tensors on rank 2, 3 on rank 0"),
    (BASE + [("c", (1,), torch.int64)], "c", "4 tensors on rank 2"),
    ([BASE[1], BASE[0], BASE[2]], "a.weight", "a.bias"),
])
def test_a_differing_state_dict_is_an_error_on_every_rank_naming_the_tensor(other, naming,
                                                                             detail):
    errs = check_with(3, [BASE, BASE, other])
    for r, e in enumerate(errs):
        assert isinstance(e, gpucast.MismatchError), (r, e)
        assert isinstance(e, gpucast.ArgumentError)
        msg = str(e)
        assert f"{naming!r}" in msg and detail in msg and "rank 2" in msg, (r, msg)


def test_torch_s_own_calls_reach_the_backend_s_group_in_separate_processes():
    """init_process_group, new_group, broadcast, broadcast_object_list, barrier, the
    coalescing manager, the layout check and the refusals, through torch 2.x's dispatch, with
    a stand-in for the GPU communicator (see fake_backend_main.py)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "fake_backend_main.py")],
                              env=dict(env, RANK_ARG=str(r), WORLD_ARG="2", PORT_ARG=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"rank {r}:\n{err[-4000:]}"
        assert out.strip().endswith(f"ok rank {r}"), out


def test_torch_tensors_off_the_gpu_are_refused_as_their_methods_read_them():
    """A torch tensor is read through torch's DLPack exchange API where that gives the facts its
    methods give, else through the methods: on the CPU, both refuse it with the methods'
    error, with a torch function mode on or not."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cases = [torch.ones(4), torch.nn.Parameter(torch.ones(4)), torch.ones(4, 4).t(),
             torch.empty(0), torch.tensor(1.0), torch.empty(4, device="meta"),
             torch.empty(4, dtype=torch.uint4)]
    for mode in [None, Passing]:
        for t in cases:
            for device in [None, 0]:
                with pytest.raises(gpucast.ArgumentError, match="not in CUDA device memory"):
                    if mode is None:
                        gpucast.describe_tensor(t, device=device)
                    else:
                        with mode():
                            gpucast.describe_tensor(t, device=device)
