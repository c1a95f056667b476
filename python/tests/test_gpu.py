"""gpucast's Python package on a GPU, with torch: bit-exact broadcasts of every dtype on every
path, fused calls, torch streams held back, tensors dropped at once, and several processes.

With one GPU, ranks share it (`shared_devices=True`); with two or more, a clique takes two
distinct GPUs too. The multi-process cases run every process on GPU 0 in the shared-device
mode (NCCL needs one GPU per process; with one GPU the NCCL path of a communicator is not
run here)."""

import contextlib
import os
import secrets
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpucast  # noqa: E402
from procs import SAFE_ENV, collect, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = torch.cuda.device_count()
os.environ.update(SAFE_ENV)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.uint32, torch.int64, torch.uint64, torch.bool, torch.complex64,
          torch.int16]


def random_bits(n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device)


def poisoned_like(t, device):
    p = torch.empty(t.shape, dtype=t.dtype, device=device)
    p.view(torch.uint8).fill_(0xA5) if p.numel() else None
    return p


def bits(t):
    return t.contiguous().view(torch.uint8).cpu()


def cliques():
    """Cliques to run: three ranks sharing GPU 0, and two GPUs when present."""
    out = [("shared", gpucast.Clique([0, 0, 0], shared_devices=True))]
    if GPUS >= 2:
        out.append(("two-gpus", gpucast.Clique([0, 1])))
    return out


@pytest.fixture(scope="module")
def all_cliques():
    return cliques()


def test_every_dtype_and_size_arrives_bit_exact_on_every_path(all_cliques):
    seed = 0
    for label, clique in all_cliques:
        paths = [None, "p2p", "copy-engine"] + (["nccl"] if label == "two-gpus" else [])
        for dtype in DTYPES:
            for n in [0, 1, 7, 4096, 65537, (1 << 21) + 3]:
                for path in paths:
                    seed += 1
                    x = random_bits(n, dtype, f"cuda:{clique.devices[0]}", seed)
                    outs = [poisoned_like(x, f"cuda:{d}") for d in clique.devices]
                    clique.broadcast(0, x, outs, path=path)
                    want = bits(x)
                    for r, o in enumerate(outs):
                        assert torch.equal(bits(o), want), (label, dtype, n, path, r)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_a_call_leaves_torch_s_current_device_alone():
    clique = gpucast.Clique([0, 1])
    torch.cuda.set_device(0)
    x = torch.ones(1 << 10, device="cuda:0")
    clique.broadcast(0, x, [torch.empty_like(x), torch.empty(1 << 10, device="cuda:1")])
    assert torch.cuda.current_device() == 0


def test_a_forced_path_that_cannot_run_is_an_unavailable_error():
    clique = gpucast.Clique([0, 0], shared_devices=True)
    x = torch.ones(16, device="cuda:0")
    with pytest.raises(gpucast.UnavailableError):
        clique.broadcast(0, x, [torch.empty_like(x), torch.empty_like(x)], path="nccl")


def test_in_place_and_fused_calls_of_mixed_tensors(all_cliques):
    for label, clique in all_cliques:
        devs = clique.devices
        shapes = [(i * 53 % 500 + 1,) for i in range(150)] + [(512, 1024), (0,), (3, 4, 5)]
        dts = [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float16]
        src = [random_bits(int(torch.tensor(s).prod()), dts[i % 5], f"cuda:{devs[1]}", 500 + i)
               .view(s) for i, s in enumerate(shapes)]
        outs = [[poisoned_like(t, f"cuda:{d}") for t in src] for d in devs]
        clique.broadcast_many(1, src, outs)
        for r in range(len(devs)):
            for t, o in zip(src, outs[r]):
                assert torch.equal(bits(o), bits(t)), (label, r)
        # In place, the root's own list as the source.
        lists = [[t.to(f"cuda:{d}") if r == 0 else poisoned_like(t, f"cuda:{d}") for t in src]
                 for r, d in enumerate(devs)]
        clique.broadcast_many_in_place(0, lists)
        for r in range(len(devs)):
            for t, o in zip(src, lists[r]):
                assert torch.equal(bits(o), bits(t)), (label, r)
        single = [src[150].to(f"cuda:{d}") if r == 2 % len(devs) else poisoned_like(src[150], f"cuda:{d}")
                  for r, d in enumerate(devs)]
        clique.broadcast_in_place(2 % len(devs), single)
        for o in single:
            assert torch.equal(bits(o), bits(src[150]))


def test_bad_arguments_raise_before_any_work():
    clique = gpucast.Clique([0, 0], shared_devices=True)
    x = torch.ones(64, device="cuda:0")
    with pytest.raises(gpucast.ArgumentError, match="outputs"):
        clique.broadcast(0, x, [torch.empty_like(x)])
    with pytest.raises(gpucast.ArgumentError, match="root"):
        clique.broadcast(5, x, [torch.empty_like(x), torch.empty_like(x)])
    with pytest.raises(gpucast.ArgumentError, match="contiguous"):
        y = torch.ones(8, 8, device="cuda:0").t()
        clique.broadcast(0, y, [torch.empty(64, device="cuda:0")] * 2)
    with pytest.raises(gpucast.ArgumentError, match="CUDA device memory"):
        clique.broadcast(0, torch.ones(64), [torch.empty_like(x), torch.empty_like(x)])
    with pytest.raises(gpucast.ArgumentError, match="elements"):
        clique.broadcast(0, x, [torch.empty(63, device="cuda:0"), torch.empty_like(x)])
    if GPUS >= 2:
        with pytest.raises(gpucast.ArgumentError, match="cuda:1"):
            clique.broadcast(0, x.to("cuda:1"), [torch.empty_like(x), torch.empty_like(x)])
    # A read-only output is refused.
    class ReadOnly:
        def __init__(self, t):
            self.t = t
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), True), "shape": (64,),
                                             "typestr": "<f4", "version": 3}
    with pytest.raises(gpucast.ArgumentError, match="read-only"):
        clique.broadcast(0, x, [ReadOnly(torch.empty_like(x)), torch.empty_like(x)])
    # A pointer past the end of its allocation is refused by the driver check.
    class Liar:
        def __init__(self, t):
            self.t = t
            self.__cuda_array_interface__ = {"data": (t.data_ptr(), False),
                                             "shape": (1 << 32,), "typestr": "<f4",
                                             "version": 3}
    with pytest.raises(gpucast.ArgumentError, match="past the end|not device memory"):
        clique.broadcast(0, Liar(torch.ones(1 << 20, device="cuda:0")),
                         [torch.empty(1 << 20, device="cuda:0")] * 2)


def test_torch_tensors_are_described_as_their_methods_read_them():
    """Tensors of the exact torch types are read through torch's DLPack exchange API (one C
    call) where it decides, else through their methods (empty tensors; every tensor while a
    torch function mode is on): each way gives the methods' facts and refusals, with torch's
    current stream of the device."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    base = torch.arange(64, dtype=torch.float32, device="cuda:0")
    cases = [base, base[3:20], base.view(8, 8), base.view(64, 1),
             torch.tensor(3.0, device="cuda:0"),
             torch.empty(8, 1, device="cuda:0").as_strided((8, 1), (1, 5)),
             torch.nn.Parameter(base.clone()), base.clone().requires_grad_(),
             torch.empty(0, device="cuda:0"),
             torch.empty(0, 3, device="cuda:0")]
    cases += [torch.empty(6, dtype=d, device="cuda:0")
              for d in DTYPES + [torch.complex32, torch.complex128, torch.float8_e4m3fn]]
    try:
        sub_byte = torch.empty(4, dtype=torch.uint4, device="cuda:0")
    except (RuntimeError, TypeError):
        sub_byte = None
    side = torch.cuda.Stream()
    for mode in [contextlib.nullcontext, Passing]:
        for stream in [None, side]:
            with torch.cuda.stream(stream), mode():
                want = torch.cuda.current_stream(0).cuda_stream
                for t in cases:
                    d = gpucast.describe_tensor(t, device=0)
                    assert d["ptr"] == t.data_ptr(), (t.shape, t.dtype)
                    assert d["nbytes"] == t.numel() * t.element_size(), (t.shape, t.dtype)
                    assert d["stream"] == want, (t.shape, t.dtype)
                    assert d["owner"] is t
                with pytest.raises(gpucast.ArgumentError, match="contiguous"):
                    gpucast.describe_tensor(base.view(8, 8).t(), device=0)
                if sub_byte is not None:  # DLPack calls it uint8: read as torch.uint4
                    with pytest.raises(gpucast.ArgumentError, match="unsupported dtype"):
                        gpucast.describe_tensor(sub_byte, device=0)
                if GPUS >= 2:
                    with pytest.raises(gpucast.ArgumentError, match="cuda:1"):
                        gpucast.describe_tensor(base.to("cuda:1"), device=0)


class Plain(torch.Tensor):
    """A tensor subclass defined outside torch, read through its methods."""


def test_lazy_negated_or_conjugated_views_are_refused_and_subclasses_get_torch_s_stream():
    """A view whose memory holds other values than it reads as (torch's lazy conjugate and
    negative bits) is refused on both ways of reading a tensor; a torch.Tensor subclass defined
    anywhere is ordered on torch's current stream, not the legacy one."""
    z = torch.randn(8, dtype=torch.complex64, device="cuda:0")
    x = torch.randn(8, device="cuda:0")
    side = torch.cuda.Stream()
    clique = gpucast.Clique([0, 0], shared_devices=True)
    for t, resolve in [(z.conj(), "resolve_conj"), (z[:1].conj().imag, "resolve_neg"),
                       (torch._neg_view(x), "resolve_neg"),
                       (z.as_subclass(Plain).conj(), "resolve_conj"),
                       (torch._neg_view(x).as_subclass(Plain), "resolve_neg")]:
        assert t.is_contiguous()
        with pytest.raises(gpucast.ArgumentError, match=resolve):
            gpucast.describe_tensor(t, device=0)
        plain = t.resolve_conj().resolve_neg()
        with pytest.raises(gpucast.ArgumentError, match=resolve):
            clique.broadcast(0, t, [torch.empty_like(plain), torch.empty_like(plain)])
        with pytest.raises(gpucast.ArgumentError, match=resolve):
            clique.broadcast(0, plain, [torch.empty_like(plain), t])
    with torch.cuda.stream(side):
        d = gpucast.describe_tensor(x.as_subclass(Plain), device=0)
    assert d["stream"] == side.cuda_stream


FAKE_TABLE = """
import ctypes, sys, torch
import gpucast
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_New.restype = ctypes.py_object
api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
name = b"dlpack_exchange_api"
real = api.PyCapsule_GetPointer(torch.Tensor.__dlpack_c_exchange_api__, name)
table = (ctypes.c_void_p * 7).from_buffer_copy((ctypes.c_void_p * 7).from_address(real))
# Another producer's table: the same view, but a current stream that is always the null one.
STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32,
                          ctypes.POINTER(ctypes.c_void_p))
null_stream = STREAM(lambda kind, dev, out: (out.__setitem__(0, None), 0)[1])
table[6] = ctypes.cast(null_stream, ctypes.c_void_p)
torch.Tensor.__dlpack_c_exchange_api__ = api.PyCapsule_New(ctypes.addressof(table), name, None)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    d = gpucast.describe_tensor(torch.ones(4, device="cuda:0"), device=0)
print(d["stream"] == side.cuda_stream, d["stream"], side.cuda_stream)
sys.exit(0 if d["stream"] == side.cuda_stream else 1)
"""


def test_a_replaced_exchange_table_is_not_trusted():
    """torch.Tensor.__dlpack_c_exchange_api__ replaced by another producer's table (here one
    whose current stream is always the null stream) is not used: tensors are then read through
    their methods, on torch's current stream."""
    r = subprocess.run([sys.executable, "-c", FAKE_TABLE], capture_output=True, text=True,
                       timeout=120, env=os.environ)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_side_stream_held_back_is_waited_for_both_ways():
    clique = gpucast.Clique([0, 0], shared_devices=True)
    n = 1 << 22
    for path in [None, "p2p", "copy-engine"]:
        side = torch.cuda.Stream()
        want = random_bits(n, torch.int32, "cuda:0", 4242)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            x = torch.zeros(n, dtype=torch.int32, device="cuda:0")
            outs = [torch.zeros(n, dtype=torch.int32, device="cuda:0") for _ in range(2)]
            torch.cuda._sleep(100_000_000)  # tens of ms on the side stream
            x.copy_(want)
            clique.broadcast(0, x, outs, path=path)
            got = [o.clone() for o in outs]
        side.synchronize()
        for g in got:
            assert torch.equal(g, want), path
        # gpucast's own streams held back: work on the caller's stream after the call waits.
        with torch.cuda.stream(side):
            x2 = want + 1
            outs2 = [torch.zeros(n, dtype=torch.int32, device="cuda:0") for _ in range(2)]
        side.synchronize()
        held = torch.cuda.ExternalStream(clique.stream_handle(1))
        with torch.cuda.stream(held):
            torch.cuda._sleep(100_000_000)
        with torch.cuda.stream(side):
            clique.broadcast(0, x2, outs2, path=path)
            got2 = outs2[1].clone()
        side.synchronize()
        assert torch.equal(got2, want + 1), path


def test_tensors_dropped_at_once_are_kept_until_the_call_has_run():
    """The input lives on stream A, the call is ordered with stream B: once the input is
    dropped, torch's allocator may hand its memory to a tensor written on A at once, which
    nothing orders after the call; only gpucast keeping the input alive saves the output."""
    clique = gpucast.Clique([0, 0], shared_devices=True)
    n = 1 << 24
    a = torch.cuda.Stream()
    for path in [None, "p2p", "copy-engine"]:
        want = random_bits(n, torch.int32, "cuda:0", 77)
        outs = [torch.zeros(n, dtype=torch.int32, device="cuda:0") for _ in range(2)]
        with torch.cuda.stream(a):
            x = want.clone()
        torch.cuda.synchronize()
        held = torch.cuda.ExternalStream(clique.stream_handle(0))
        with torch.cuda.stream(held):
            torch.cuda._sleep(200_000_000)
        clique.broadcast(0, x, outs, path=path)  # ordered with the default stream
        del x
        with torch.cuda.stream(a):
            y = torch.empty(n, dtype=torch.int32, device="cuda:0")
            y.fill_(-1)
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(o, want), path
        del y


def test_several_threads_share_a_clique():
    """Four threads, each on its own torch stream, broadcast through one clique; a short
    timeout turns a stuck call into an error at once, and the first error stops a thread."""
    import threading
    clique = gpucast.Clique([0, 0], shared_devices=True, timeout=3.0)
    errors = []

    def worker(k):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(40):
                    x = random_bits(1000 + i * 97, torch.int32, "cuda:0", k * 1000 + i)
                    outs = [torch.empty_like(x) for _ in range(2)]
                    clique.broadcast(0, x, outs)
                    for o in outs:
                        if not torch.equal(o, x):
                            errors.append(f"thread {k} call {i}: wrong output")
                            return
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:4]


def run_ranks(case, world, extra=None, timeout=240):
    port = free_port()
    token = secrets.token_hex(16)
    procs = []
    for rank in range(world):
        env = dict(os.environ, **SAFE_ENV, CASE=case, RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GPUCAST_JOB_TOKEN=token, **(extra or {}))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "rank_main.py")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return collect(procs, timeout)


@pytest.mark.parametrize("case", ["broadcast", "many"])
def test_processes_on_one_gpu_broadcast_bit_exact(case):
    for rc, out, err in run_ranks(case, 3):
        assert rc == 0, err[-3000:]
        assert out.startswith(f"ok {case}"), out


def test_an_absent_peer_is_a_timeout_error_not_a_hang():
    start = time.monotonic()
    res = run_ranks("absent-peer", 2, {"TIMEOUT_S": "3"})
    for rc, out, err in res:
        assert rc == 0, err[-3000:]
    assert time.monotonic() - start < 120


def test_ranks_that_pass_different_sizes_all_get_an_error():
    res = run_ranks("mismatch", 2, {"TIMEOUT_S": "3", "EXPECT_MISMATCH": "1"})
    for rc, out, err in res:
        assert rc == 0, err[-3000:]
