"""gpucast as a ``torch.distributed`` backend named ``"gpucast"``.

``import gpucast.torch`` registers it; then::

    dist.init_process_group("gpucast", ...)            # or
    group = dist.new_group(ranks, backend="gpucast")
    dist.broadcast(t, src=0, group=group)               # in place, gpucast's fused engine
    dist.broadcast_object_list(objs, src=0, group=group)
    dist.barrier(group=group)
    gpucast.torch.broadcast_coalesced(tensors, src=0, group=group)     # one fused call
    with dist._coalescing_manager(group, device=dev):                  # the same, torch's way
        for t in tensors:
            dist.broadcast(t, src=0, group=group)

Every other collective (all-reduce, all-gather, reduce-scatter, send/recv, ...) raises
``NotImplementedError`` naming what to use instead: a second group of NCCL (or gloo) on the
same ranks, e.g. ``dist.new_group(ranks, backend="nccl")``; nothing is forwarded silently.

The group's ranks meet through the store torch hands the backend (no port of gpucast's own),
and build a :class:`gpucast.Communicator` on the current CUDA device
(``torch.cuda.set_device`` before ``init_process_group``). Ranks that share a GPU (several
processes on GPU 0) are found at that meeting and use gpucast's shared-device mode. Settings
(``timeout``, ``path``, thresholds) come from :func:`configure`; ``init_process_group(timeout=)``
bounds the meeting, the store's waits and ``dist.barrier``, while each wait of a broadcast keeps
gpucast's own bound (10 s unless configured).

Supported: torch 2.11 (the version tested, on CPU in CI and on the GPU machine). It relies on
``Backend.register_backend(name, creator, devices=)`` and on a creator that returns a Python
subclass of ``torch.distributed.ProcessGroup``, which replaces torch's group object; older
versions with both may work but are not tested.
"""

import datetime
import socket
import threading

import torch
import torch.distributed as dist

from . import Communicator
from .weights import check_layout

#: The name under which the backend is registered.
BACKEND = "gpucast"

_settings = {}
_settings_lock = threading.Lock()


def configure(**settings):
    """Settings for the groups created after this call, as :class:`gpucast.Communicator`
    takes them (``path``, ``timeout``, ``p2p_threshold``, ``shared_devices``,
    ``init_timeout``, ...). Every rank must choose alike. ``configure()`` resets them."""
    allowed = {"path", "timeout", "p2p_threshold", "packet_threshold", "copy_engine_threshold",
               "p2p_chain_threshold", "shared_devices", "init_timeout"}
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise TypeError(f"gpucast.torch.configure: unknown settings {unknown}; "
                        f"known: {sorted(allowed)}")
    with _settings_lock:
        _settings.clear()
        _settings.update(settings)


def _refuse(op, instead):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"the gpucast backend only broadcasts (dist.broadcast, broadcast_object_list, "
            f"barrier, coalesced broadcasts): {op} is not one of them. {instead}")

    method.__name__ = op
    method.__doc__ = f"Refused: {op} is not a broadcast."
    return method


_NCCL = ("Use a group of another backend on the same ranks for it, e.g. "
         "dist.new_group(ranks, backend=\"nccl\") (\"gloo\" for CPU tensors).")


class _Done(dist._Work):
    """A call's work: queued on the caller's current stream, as NCCL's is, so ``wait`` has
    nothing to wait for (work queued on that stream after the call sees its result)."""

    def __init__(self, tensors):
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._tensors

    def get_future(self):
        f = torch.futures.Future()
        f.set_result(self._tensors)
        return f


class ProcessGroupGpucast(dist.ProcessGroup):
    """The ``"gpucast"`` backend's process group: broadcasts through a
    :class:`gpucast.Communicator`, refuses every other collective."""

    def __init__(self, rank, size, communicator, store=None, timeout=None):
        super().__init__(rank, size)
        self._comm = communicator
        # Bound once: the per-call path does no lookups beyond these.
        self._many = communicator.broadcast_many if communicator is not None else None
        self._one = communicator.broadcast if communicator is not None else None
        device = communicator.device if communicator is not None else None
        self._device = torch.device("cuda", device) if isinstance(device, int) else device
        self._store = store
        self._timeout = timeout or datetime.timedelta(seconds=300)
        self._barriers = 0
        self._coalescing = None
        # What a blocking call returns: torch only waits on it, so one serves every call.
        self._done = _Done([])

    # What torch asks of every group.
    def getBackendName(self):
        return BACKEND

    def name(self):
        return BACKEND

    @property
    def communicator(self):
        """The :class:`gpucast.Communicator` under this group."""
        return self._comm

    # The broadcasts.
    def broadcast(self, tensor_list, opts=None):
        src = opts.rootRank if opts is not None else 0
        if self._coalescing is not None:
            self._coalescing.append((tensor_list, src))
            return _Done(tensor_list)
        t = tensor_list[0]
        if len(tensor_list) == 1 and t.is_cuda:
            self._one(t, src)
        else:
            self._broadcast_any(tensor_list, src)
        return _Done(tensor_list) if opts is None or opts.asyncOp else self._done

    def _broadcast_any(self, tensor_list, src):
        """Tensors on the CPU (``broadcast_object_list``'s) go through the GPU."""
        staged = [t if t.is_cuda else t.to(self._device) for t in tensor_list]
        self._many(staged, src)
        for t, s in zip(tensor_list, staged):
            if s is not t:
                t.copy_(s)

    def broadcast_coalesced(self, tensors, src=0, check=False):
        """Broadcasts ``tensors`` (a list, or a dict such as a state_dict) from group rank
        ``src`` in one fused call (see the module)."""
        if hasattr(tensors, "items"):
            named = list(tensors.items())
        else:
            named = [(f"tensor {i}", t) for i, t in enumerate(tensors)]
        tensors = [t for _, t in named]
        if check:
            check_layout(self._comm, named, src)
        if all(t.is_cuda for t in tensors):
            self._many(tensors, src)
        else:
            self._broadcast_any(tensors, src)
        return _Done(tensors)

    def _start_coalescing(self, device=None):
        self._coalescing = []

    def _end_coalescing(self, device=None):
        ops, self._coalescing = self._coalescing or [], None
        if not ops:
            return _Done([])
        roots = {src for _, src in ops}
        if len(roots) != 1:
            raise NotImplementedError(
                f"the gpucast backend fuses broadcasts of one root only; this coalescing "
                f"block has roots {sorted(roots)}")
        tensors = [t for ts, _ in ops for t in ts]
        return self.broadcast_coalesced(tensors, ops[0][1])

    def barrier(self, opts=None):
        """Every rank's broadcasts so far have finished here, and every rank has come (through
        the store, bounded by the group's timeout)."""
        self._comm.synchronize()
        n = self._barriers
        self._barriers += 1
        if self.size() > 1:
            self._store.set(f"gpucast/barrier/{n}/{self.rank()}", b"1")
            keys = [f"gpucast/barrier/{n}/{r}" for r in range(self.size())]
            self._store.wait(keys, self._timeout)
        return _Done([])

    # The rest: refused.
    allreduce = _refuse("all_reduce", _NCCL)
    allreduce_coalesced = _refuse("all_reduce_coalesced", _NCCL)
    reduce = _refuse("reduce", _NCCL)
    allgather = _refuse("all_gather", _NCCL)
    _allgather_base = _refuse("all_gather_into_tensor", _NCCL)
    allgather_coalesced = _refuse("all_gather_coalesced", _NCCL)
    allgather_into_tensor_coalesced = _refuse("all_gather_into_tensor_coalesced", _NCCL)
    gather = _refuse("gather", _NCCL)
    scatter = _refuse("scatter", _NCCL)
    reduce_scatter = _refuse("reduce_scatter", _NCCL)
    _reduce_scatter_base = _refuse("reduce_scatter_tensor", _NCCL)
    reduce_scatter_tensor_coalesced = _refuse("reduce_scatter_tensor_coalesced", _NCCL)
    alltoall = _refuse("all_to_all", _NCCL)
    alltoall_base = _refuse("all_to_all_single", _NCCL)
    send = _refuse("send", _NCCL)
    recv = _refuse("recv", _NCCL)
    recv_anysource = _refuse("recv (any source)", _NCCL)
    monitored_barrier = _refuse("monitored_barrier", "Use dist.barrier, or a gloo group.")


#: The collectives the backend refuses (torch's method names).
REFUSED = ("allreduce", "allreduce_coalesced", "reduce", "allgather", "_allgather_base",
           "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
           "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
           "alltoall", "alltoall_base", "send", "recv", "recv_anysource", "monitored_barrier")


class _StoreGather:
    """An all-gather of small byte strings over a ``torch.distributed`` store: round ``k``
    puts rank ``r``'s bytes under ``gpucast/k/r``; each wait is bounded by ``timeout``."""

    def __init__(self, store, rank, size, timeout):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.round = 0

    def __call__(self, mine):
        k = self.round
        self.round += 1
        self.store.set(f"gpucast/{k}/{self.rank}", bytes(mine))
        keys = [f"gpucast/{k}/{r}" for r in range(self.size)]
        self.store.wait(keys, self.timeout)
        return [bytes(self.store.get(key)) for key in keys]


def _device_key(device):
    """This process's host and GPU, to find ranks that share one."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device))
    return f"{socket.gethostname()}|{uuid}".encode()


def _create(store, rank, size, timeout):
    """The backend's creator: torch's store, this rank's group rank and size, its timeout."""
    with _settings_lock:
        settings = dict(_settings)
    comm = _communicator(store, rank, size, timeout, settings)
    return ProcessGroupGpucast(rank, size, comm, store=store, timeout=timeout)


def _communicator(store, rank, size, timeout, settings):
    """This rank's communicator, its ranks meeting through `store` (the CPU tests put a
    stand-in here, to run torch's side of the backend without a GPU)."""
    if not torch.cuda.is_available():
        from .errors import UnavailableError

        raise UnavailableError("the gpucast backend broadcasts between CUDA GPUs, and torch "
                               "sees none here")
    device = torch.cuda.current_device()
    gather = _StoreGather(store, rank, size, timeout)
    if "shared_devices" not in settings:
        keys = gather(_device_key(device))
        settings["shared_devices"] = len(set(keys)) < len(keys)
    # torch's timeout (default 30 min) bounds the meeting; each wait of a broadcast keeps
    # gpucast's own bound (10 s, or configure(timeout=)), so a mismatch or a dead peer is an
    # error in seconds.
    if "init_timeout" not in settings and timeout is not None:
        settings["init_timeout"] = timeout.total_seconds()
    return Communicator.from_exchange(gather, rank=rank, world_size=size, device=device,
                                      **settings)


def broadcast_coalesced(tensors, src=0, group=None, *, check=False):
    """Broadcasts every tensor of ``tensors`` (a list, or a dict such as a state_dict, whose
    names then appear in a mismatch's error) from rank ``src`` (a global rank, as
    ``dist.broadcast``'s) in one fused call of the gpucast group ``group`` (default: the
    default group), in place, with no packing buffer. Every rank passes tensors of the same
    shapes and dtypes; ``check=True`` checks that first (a :class:`gpucast.MismatchError`
    naming the first differing tensor on every rank, instead of a failed or wrong call).
    Ordered as ``dist.broadcast``: on each tensor's current stream."""
    pg = _gpucast_group(group)
    group_src = src if group is None else dist.get_group_rank(group, src)
    return pg.broadcast_coalesced(tensors, group_src, check=check)


def communicator(group=None):
    """The :class:`gpucast.Communicator` of a gpucast group (default: the default group)."""
    return _gpucast_group(group).communicator


def _gpucast_group(group):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupGpucast):
        raise TypeError(f"not a group of the gpucast backend: {pg!r} (create one with "
                        f"dist.new_group(ranks, backend=\"gpucast\") after import gpucast.torch)")
    return pg


def _register():
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["cuda"])


_register()
