"""gpucast's exceptions: every error a call raises is a :class:`Error`.

Each subclass says what went wrong; the message is gpucast's own (what failed, on which rank,
and the fix where there is one). Argument errors are raised before any GPU work is queued.
"""

import builtins


class Error(Exception):
    """Base class of every gpucast error."""


class ArgumentError(Error, ValueError):
    """A bad argument or setting (a tensor on the wrong device, not contiguous, an unknown
    dtype, lengths that differ, a root out of range): raised before any GPU work."""


class TimeoutError(Error, builtins.TimeoutError):
    """A wait ran past its bound: a peer that did not arrive within the timeout (a dead,
    stalled or mismatched rank), or streams that stayed busy."""


class AbortedError(Error):
    """The NCCL communicators were aborted after a timeout; the NCCL path stays closed until
    a new communicator is built."""


class UnavailableError(Error):
    """A forced path (``path="p2p"``, ``"nccl"``, ``"copy-engine"``) cannot run here."""


class LibraryError(Error, ImportError):
    """A CUDA, NCCL or NVRTC library could not be loaded; the message names the fix."""


class RendezvousError(Error):
    """Ranks could not find each other, or a process outside the job was refused."""


class MismatchError(ArgumentError):
    """Ranks hold different tensors for one call (a count, shape or dtype; a state_dict of
    another model): raised on every rank, the source's too, naming the first tensor that
    differs (see :func:`gpucast.broadcast_state_dict`)."""


__all__ = [
    "Error",
    "ArgumentError",
    "TimeoutError",
    "AbortedError",
    "UnavailableError",
    "LibraryError",
    "RendezvousError",
    "MismatchError",
]
