"""What gpucast's Python package does without a GPU: it imports, reads tensors (shapes,
strides, dtypes, streams) exactly, and turns bad arguments and a missing driver into
gpucast's exceptions, before any GPU work."""

import inspect
import os
import subprocess
import sys

import pytest

import gpucast
from gpucast import errors

np = pytest.importorskip("numpy")


class CudaArray:
    """A fake device array that speaks __cuda_array_interface__ (version 3)."""

    def __init__(self, ptr=0x7F0000000000, shape=(4, 3), typestr="<f4", strides=None,
                 stream=None):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }
        if stream is not None:
            self.__cuda_array_interface__["stream"] = stream


def test_the_package_exports_its_api_and_exceptions():
    for name in ["Communicator", "Clique", "nccl_version", "describe_tensor", "Error",
                 "ArgumentError", "TimeoutError", "AbortedError", "UnavailableError",
                 "LibraryError", "RendezvousError"]:
        assert hasattr(gpucast, name), name
    assert gpucast.MAX_GPUS == 8
    assert issubclass(gpucast.ArgumentError, ValueError)
    assert issubclass(gpucast.TimeoutError, TimeoutError)
    assert issubclass(gpucast.LibraryError, ImportError)
    for cls in [gpucast.ArgumentError, gpucast.TimeoutError, gpucast.AbortedError,
                gpucast.UnavailableError, gpucast.LibraryError, gpucast.RendezvousError]:
        assert issubclass(cls, gpucast.Error)


def test_signatures_are_torch_distributed_s_shape():
    c = gpucast.Communicator
    assert str(inspect.signature(c.broadcast)) == "(self, /, tensor, src=0, *, path=None, stream=None)"
    assert str(inspect.signature(c.broadcast_many)) == "(self, /, tensors, src=0, *, path=None, stream=None)"
    params = inspect.signature(c.from_env).parameters
    for name in ["device", "shared_devices", "init_timeout", "path", "timeout",
                 "p2p_threshold", "packet_threshold", "copy_engine_threshold"]:
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    q = gpucast.Clique
    assert str(inspect.signature(q.broadcast)) == "(self, /, src, tensor, outputs, *, path=None, stream=None)"
    for name in ["broadcast_in_place", "broadcast_many", "broadcast_many_in_place",
                 "synchronize", "route"]:
        assert callable(getattr(q, name)), name


def test_host_arrays_are_read_exactly_through_dlpack():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = gpucast.describe_tensor(a)
    assert d["ptr"] == a.ctypes.data
    assert (d["len"], d["dtype"], d["nbytes"]) == (12, "f32", 48)
    assert d["owner"][0] is a
    for dtype, name, per in [(np.float64, "f64", 1), (np.float16, "f16", 1), (np.int8, "i8", 1),
                             (np.uint8, "u8", 1), (np.int32, "i32", 1), (np.uint32, "u32", 1),
                             (np.int64, "i64", 1), (np.uint64, "u64", 1), (np.bool_, "u8", 1),
                             (np.int16, "f16", 1), (np.complex64, "f32", 2),
                             (np.complex128, "f64", 2)]:
        d = gpucast.describe_tensor(np.zeros(5, dtype=dtype))
        assert (d["dtype"], d["len"]) == (name, 5 * per), dtype
    zero = gpucast.describe_tensor(np.zeros((0, 7), dtype=np.float32))
    assert zero["len"] == 0
    scalar = gpucast.describe_tensor(np.array(3.0, dtype=np.float32))
    assert scalar["len"] == 1
    # A slice that starts inside the array: the address is the slice's.
    b = np.arange(10, dtype=np.int64)[2:]
    assert gpucast.describe_tensor(b)["ptr"] == b.ctypes.data


def test_non_contiguous_tensors_are_refused_before_any_work():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(gpucast.ArgumentError, match="not contiguous"):
        gpucast.describe_tensor(a.T)
    with pytest.raises(gpucast.ArgumentError, match="not contiguous"):
        gpucast.describe_tensor(a[:, ::2])
    # Dimensions of size one may have any stride.
    gpucast.describe_tensor(a[1:2, :])


def test_host_memory_is_refused_where_a_device_is_wanted():
    with pytest.raises(gpucast.ArgumentError, match="not in CUDA device memory"):
        gpucast.describe_tensor(np.zeros(4, dtype=np.float32), device=0)


def test_cuda_array_interface_is_read_with_its_stream():
    d = gpucast.describe_tensor(CudaArray(shape=(4, 3), typestr="<f2"))
    assert (d["ptr"], d["len"], d["dtype"], d["stream"]) == (0x7F0000000000, 12, "f16", 0)
    assert gpucast.describe_tensor(CudaArray(stream=1))["stream"] == 0  # legacy default
    assert gpucast.describe_tensor(CudaArray(stream=0x1234))["stream"] == 0x1234
    assert gpucast.describe_tensor(CudaArray(stream=0x1234), stream=0x99)["stream"] == 0x99
    # C-contiguous strides in bytes are fine; a transpose is not.
    gpucast.describe_tensor(CudaArray(shape=(4, 3), strides=(12, 4)))
    with pytest.raises(gpucast.ArgumentError, match="not contiguous"):
        gpucast.describe_tensor(CudaArray(shape=(4, 3), strides=(4, 16)))
    with pytest.raises(gpucast.ArgumentError, match="unsupported typestr"):
        gpucast.describe_tensor(CudaArray(typestr=">f4"))
    with pytest.raises(gpucast.ArgumentError, match="shape"):
        gpucast.describe_tensor(CudaArray(shape=(-1, 3)))
    masked = CudaArray()
    masked.__cuda_array_interface__["mask"] = CudaArray()
    with pytest.raises(gpucast.ArgumentError, match="masked"):
        gpucast.describe_tensor(masked)
    # Read-only is fine for reading (a call that writes it refuses it).
    ro = CudaArray()
    ro.__cuda_array_interface__["data"] = (0x7F0000000000, True)
    assert gpucast.describe_tensor(ro)["len"] == 12
    with pytest.raises(gpucast.ArgumentError, match="shape"):
        gpucast.describe_tensor(CudaArray(shape=(1 << 40, 1 << 40)))


def test_garbage_tensors_raise_argument_errors():
    class NotACapsule:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            return "not a capsule"

    with pytest.raises(gpucast.ArgumentError, match="capsule"):
        gpucast.describe_tensor(NotACapsule())

    class Failing:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            raise BufferError("cannot export")

    with pytest.raises(gpucast.ArgumentError, match="cannot export"):
        gpucast.describe_tensor(Failing())
    with pytest.raises(gpucast.ArgumentError, match="expected a tensor"):
        gpucast.describe_tensor(object())
    with pytest.raises(gpucast.ArgumentError):
        gpucast.describe_tensor(CudaArray(typestr="<V2"))

    class NotADict:
        __cuda_array_interface__ = [1, 2]

    with pytest.raises(gpucast.ArgumentError, match="not a dict"):
        gpucast.describe_tensor(NotADict())


def test_bad_settings_are_argument_errors_before_any_device_is_touched():
    with pytest.raises(gpucast.ArgumentError, match="unknown path"):
        gpucast.Clique([0], path="warp-drive")
    with pytest.raises(gpucast.ArgumentError, match="seconds"):
        gpucast.Clique([0], timeout=-1.0)
    with pytest.raises(gpucast.ArgumentError, match="byte count"):
        gpucast.Clique([0], p2p_threshold="12Q")
    with pytest.raises(gpucast.ArgumentError, match="seconds"):
        gpucast.Communicator.from_env(init_timeout=float("nan"))


def run_isolated(code, env):
    """Runs `code` in a fresh interpreter with `env` added; returns its stdout."""
    full = dict(os.environ, **env)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU driver")
def test_without_a_driver_a_clique_is_a_library_error_with_a_fix():
    out = run_isolated(
        "import gpucast\n"
        "try:\n"
        "    gpucast.Clique([0])\n"
        "except gpucast.LibraryError as e:\n"
        "    print('LibraryError', e)\n",
        {},
    )
    assert out.startswith("LibraryError"), out
    assert "Fix:" in out


def test_a_communicator_outside_a_job_names_what_is_missing():
    env = {}
    code = (
        "import os, gpucast\n"
        "for k in ['RANK', 'WORLD_SIZE', 'SLURM_PROCID', 'LOCAL_RANK']:\n"
        "    os.environ.pop(k, None)\n"
        "try:\n"
        "    gpucast.Communicator.from_env()\n"
        "except gpucast.Error as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = run_isolated(code, env)
    assert out.startswith("RendezvousError"), out
    assert "RANK" in out


def test_importing_needs_no_torch():
    out = run_isolated(
        "import sys, gpucast\nprint('torch' in sys.modules)\n", {}
    )
    assert out.strip() == "False"


def test_the_type_stubs_name_what_the_module_has():
    import ast
    import gpucast._native as native

    stub = os.path.join(os.path.dirname(gpucast.__file__), "_native.pyi")
    if not os.path.exists(stub):
        pytest.skip("stubs not installed")
    tree = ast.parse(open(stub).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            cls = getattr(native, node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    assert hasattr(cls, item.name), f"{node.name}.{item.name}"
            public = {n for n in dir(cls) if not n.startswith("_")}
            stubbed = {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
            assert public <= stubbed, f"{node.name}: not in the stubs: {public - stubbed}"
        elif isinstance(node, ast.FunctionDef):
            assert hasattr(native, node.name), node.name


def crafted_capsule(ndim, shape, strides=None, code=2, bits=32, lanes=1, data=0x1000,
                    byte_offset=0, name=b"dltensor"):
    """A DLPack capsule built by hand (host memory), as a hostile or broken producer might."""
    import ctypes

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                    ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    class DLManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p)]

    keep = []
    shape_arr = None
    if shape is not None:
        shape_arr = (ctypes.c_int64 * len(shape))(*shape)
        keep.append(shape_arr)
    strides_arr = None
    if strides is not None:
        strides_arr = (ctypes.c_int64 * len(strides))(*strides)
        keep.append(strides_arr)
    t = DLManagedTensor()
    t.dl_tensor.data = data
    t.dl_tensor.device = DLDevice(1, 0)
    t.dl_tensor.ndim = ndim
    t.dl_tensor.dtype = DLDataType(code, bits, lanes)
    t.dl_tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64)) if shape_arr else None
    t.dl_tensor.strides = (ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
                           if strides_arr else None)
    t.dl_tensor.byte_offset = byte_offset
    keep.append(t)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new(ctypes.addressof(t), name, None)

    class Producer:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None):
            return capsule

    p = Producer()
    p.keep = keep
    return p


def test_hostile_dlpack_capsules_are_refused_without_reading_past_them():
    ok = gpucast.describe_tensor(crafted_capsule(2, [3, 4], byte_offset=8))
    assert (ok["len"], ok["ptr"]) == (12, 0x1000 + 8)
    with pytest.raises(gpucast.ArgumentError, match="dimensions"):
        gpucast.describe_tensor(crafted_capsule(1 << 30, [1]))
    with pytest.raises(gpucast.ArgumentError, match="dimensions"):
        gpucast.describe_tensor(crafted_capsule(-1, [1]))
    with pytest.raises(gpucast.ArgumentError, match="without a shape"):
        gpucast.describe_tensor(crafted_capsule(3, None))
    with pytest.raises(gpucast.ArgumentError, match="shape"):
        gpucast.describe_tensor(crafted_capsule(2, [-5, 4]))
    with pytest.raises(gpucast.ArgumentError, match="shape"):
        gpucast.describe_tensor(crafted_capsule(2, [1 << 40, 1 << 40]))
    with pytest.raises(gpucast.ArgumentError, match="byte offset"):
        gpucast.describe_tensor(crafted_capsule(1, [4], data=2**64 - 8, byte_offset=16))
    with pytest.raises(gpucast.ArgumentError, match="unsupported DLPack dtype"):
        gpucast.describe_tensor(crafted_capsule(1, [4], code=2, bits=32, lanes=4))
    with pytest.raises(gpucast.ArgumentError, match="not contiguous"):
        gpucast.describe_tensor(crafted_capsule(2, [3, 4], strides=[1, 3]))
    with pytest.raises(gpucast.ArgumentError, match="capsule"):
        gpucast.describe_tensor(crafted_capsule(1, [4], name=b"used_dltensor"))


def test_an_explicit_group_checks_its_arguments_before_any_device_or_network():
    c = gpucast.Communicator
    params = inspect.signature(c).parameters
    for name in ["rank", "world_size", "master_addr", "master_port", "token", "device",
                 "shared_devices", "timeout", "init_timeout"]:
        assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    with pytest.raises(TypeError):
        c(0, 2, "127.0.0.1", 29500)  # keyword-only
    with pytest.raises(TypeError):
        c(rank=0, world_size=2)  # no port
    with pytest.raises(gpucast.ArgumentError, match="rank 2 is not below the world size 2"):
        c(rank=2, world_size=2, master_port=29500)
    with pytest.raises(gpucast.ArgumentError, match="world size 0"):
        c(rank=0, world_size=0, master_port=29500)
    for port in [0, -1, 65536]:
        with pytest.raises(gpucast.ArgumentError, match="master_port"):
            c(rank=0, world_size=2, master_port=port)
    with pytest.raises(gpucast.ArgumentError, match="master address is empty"):
        c(rank=0, world_size=2, master_addr=" ", master_port=29500)
    with pytest.raises(gpucast.ArgumentError, match="token"):
        c(rank=0, world_size=2, master_port=29500, token="x" * 100_000)
    with pytest.raises(gpucast.ArgumentError, match="local rank"):
        c(rank=1, world_size=2, master_port=29500, local_rank=3, local_world_size=2)
    with pytest.raises(gpucast.ArgumentError, match="seconds"):
        c(rank=0, world_size=2, master_port=29500, timeout=0.0)
    with pytest.raises(gpucast.ArgumentError, match="unknown path"):
        c(rank=0, world_size=2, master_port=29500, path="warp-drive")


def test_a_group_over_a_caller_s_exchange_checks_its_arguments():
    f = gpucast.Communicator.from_exchange
    with pytest.raises(gpucast.ArgumentError, match="callable"):
        f(b"not callable", rank=0, world_size=2)
    with pytest.raises(gpucast.ArgumentError, match="rank 3 is not below"):
        f(lambda b: [b], rank=3, world_size=2)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU driver")
def test_an_explicit_group_without_a_driver_fails_at_once():
    out = run_isolated(
        "import time, gpucast\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    gpucast.Communicator(rank=1, world_size=2, master_port=1, init_timeout=5.0)\n"
        "except gpucast.Error as e:\n"
        "    print(type(e).__name__, round(time.monotonic() - t), e)\n",
        {},
    )
    assert out.startswith("LibraryError 0 "), out


def test_random_tokens_are_long_and_fresh():
    a, b = gpucast.random_token(), gpucast.random_token()
    assert len(a) == 64 and int(a, 16) >= 0 and a != b
