"""gpucast: broadcast tensors from one GPU to all the others.

Three ways in:

* :class:`Communicator` for jobs that run one process per GPU: under torchrun or Slurm
  (``from_env``), or an explicit group of separately launched programs that agree on an
  address (a trainer and its inference workers)::

      import torch, gpucast
      comm = gpucast.Communicator.from_env()          # under torchrun
      comm = gpucast.Communicator(rank=r, world_size=n, master_addr="10.0.0.1",
                                  master_port=29600, token=token, device=0)
      w = torch.empty(1 << 20, device=f"cuda:{comm.device}")
      comm.broadcast(w, src=0)                         # in place, as torch.distributed
      comm.broadcast_many(list(model.state_dict().values()), src=0)   # one fused call
      gpucast.broadcast_state_dict(comm, model.state_dict(), src=0)   # checked first

* ``import gpucast.torch``: a ``torch.distributed`` backend named ``"gpucast"``
  (``dist.init_process_group("gpucast")``, ``dist.new_group(ranks, backend="gpucast")``).

* :class:`Clique` for one process that drives several GPUs::

      clique = gpucast.Clique([0, 1])
      clique.broadcast(0, x, [out0, out1])

Tensors are torch tensors, or any object with ``__dlpack__`` or ``__cuda_array_interface__``
(CuPy, JAX, Numba), contiguous and on the rank's GPU; they are used in place, never copied.

Ordering is a torch operation's: a call starts after the work queued on the tensor's current
stream (``torch.cuda.current_stream()``; CuPy's current stream; the stream a
``__cuda_array_interface__`` names; else the legacy default stream, or the ``stream=`` given),
and work queued on that stream after the call sees its result. So code that writes a tensor,
broadcasts it and reads it needs no synchronize. A tensor may be dropped right after a call:
gpucast keeps it alive until the call's GPU work has run. Calls release the GIL.

Every wait is bounded (``timeout=``, default 10 s): a peer that never arrives is a
:class:`TimeoutError`, never a hang. Errors are :class:`Error` subclasses, see
:mod:`gpucast.errors`.
"""

from . import errors
from ._native import (
    MAX_GPUS,
    Clique,
    Communicator,
    describe_tensor,
    nccl_version,
    random_token,
)
from .errors import (
    AbortedError,
    ArgumentError,
    Error,
    LibraryError,
    MismatchError,
    RendezvousError,
    TimeoutError,
    UnavailableError,
)
from .weights import broadcast_state_dict, check_layout

__version__ = "0.1.0"

#: The paths a call may force with ``path=``.
PATHS = ("auto", "nccl", "p2p", "copy-engine")

__all__ = [
    "Communicator",
    "Clique",
    "nccl_version",
    "random_token",
    "broadcast_state_dict",
    "check_layout",
    "describe_tensor",
    "MAX_GPUS",
    "PATHS",
    "errors",
    "Error",
    "ArgumentError",
    "TimeoutError",
    "AbortedError",
    "UnavailableError",
    "LibraryError",
    "RendezvousError",
    "MismatchError",
]
