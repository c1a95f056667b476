"""Named tensors (a model's ``state_dict``) pushed from one rank to all the others in place,
after a check that every rank holds the same tensors.

A bucket size or a state_dict that differs between a trainer and its workers makes a raw NCCL
broadcast hang; here it is a :class:`~gpucast.errors.MismatchError` on every rank, naming the
first tensor that differs, within the communicator's timeout::

    gpucast.broadcast_state_dict(comm, model.state_dict(), src=0)

The check runs through the communicator itself (any object with ``rank``, ``world_size``,
``device`` and ``broadcast_many(tensors, src)``: a :class:`gpucast.Communicator`, or a
``gpucast.torch`` group), so it needs no second connection: the source broadcasts the list of
``(name, shape, dtype)``, every rank compares it with its own, and every rank broadcasts its
verdict in turn (``world_size`` small calls), so that every rank, the source too, raises the
same error or none. Then the tensors go in fused calls (``max_bytes`` per call; default: one
call for all), in place, with no packing buffer.
"""

import ctypes
import struct

from .errors import MismatchError

#: Bytes of each rank's verdict: an index (-1: no difference) and a message.
_VERDICT_BYTES = 512


def _torch():
    import torch

    return torch


def _layout(named):
    """``(name, shape, dtype)`` of each tensor, as lines of text."""
    lines = [f"{name}\t{tuple(t.shape)}\t{t.dtype}" for name, t in named]
    return lines


def _host_bytes(t):
    """The bytes of a contiguous uint8 tensor, copied to the host (no numpy needed)."""
    h = t.contiguous().cpu()
    return ctypes.string_at(h.data_ptr(), h.numel()) if h.numel() else b""


def _first_difference(mine, theirs):
    """Index of the first line that differs between two layouts (None if they are equal)."""
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return i
    if len(mine) != len(theirs):
        return min(len(mine), len(theirs))
    return None


def _describe(lines, i):
    if i >= len(lines):
        return "no tensor"
    name, shape, dtype = lines[i].split("\t")
    return f"{name!r} of shape {shape} and dtype {dtype}"


def check_layout(comm, named, src=0):
    """Raises :class:`~gpucast.errors.MismatchError` on every rank unless every rank's
    ``named`` (``(name, tensor)`` pairs, in order) has rank ``src``'s names, shapes and dtypes.

    Every rank of ``comm`` must call it, with its own list. Costs two broadcasts of the
    layout's text and ``world_size`` broadcasts of 512 bytes.
    """
    torch = _torch()
    named = list(named)
    device = (torch.device("cuda", comm.device) if isinstance(comm.device, int)
              else torch.device(comm.device))
    mine = _layout(named)
    text = "\n".join(mine).encode()
    # The source's layout: its length, then its text.
    header = torch.tensor([len(text)], dtype=torch.int64, device=device)
    comm.broadcast_many([header], src)
    n = int(header.item())
    buf = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
    if comm.rank == src and n:
        buf[:n].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
    comm.broadcast_many([buf], src)
    theirs = _host_bytes(buf[:n]).decode().split("\n") if n else []
    # This rank's verdict, then every rank's, each broadcast by its rank.
    at = None if comm.rank == src else _first_difference(mine, theirs)
    message = ""
    if at is not None:
        count = (f" ({len(mine)} tensors on rank {comm.rank}, {len(theirs)} on rank {src})"
                 if len(mine) != len(theirs) else "")
        name = (theirs[at] if at < len(theirs) else mine[at]).split("\t")[0]
        message = (f"rank {comm.rank}'s tensors differ from rank {src}'s (the source) at "
                   f"tensor {at}, {name!r}: rank {src} has {_describe(theirs, at)}, rank "
                   f"{comm.rank} has {_describe(mine, at)}{count}")
    raw = message.encode()[: _VERDICT_BYTES - 8]
    verdicts = torch.zeros((comm.world_size, _VERDICT_BYTES), dtype=torch.uint8, device=device)
    mine_v = struct.pack("<q", -1 if at is None else at) + raw
    verdicts[comm.rank, : len(mine_v)].copy_(torch.frombuffer(bytearray(mine_v),
                                                                dtype=torch.uint8))
    for r in range(comm.world_size):
        comm.broadcast_many([verdicts[r]], r)
    host = _host_bytes(verdicts)
    bad = []
    for r in range(comm.world_size):
        row = host[r * _VERDICT_BYTES:(r + 1) * _VERDICT_BYTES]
        (index,) = struct.unpack("<q", row[:8])
        if index >= 0:
            bad.append((r, row[8:].rstrip(b"\0").decode(errors="replace")))
    if bad:
        others = f" (and {len(bad) - 1} more ranks differ)" if len(bad) > 1 else ""
        raise MismatchError(bad[0][1] + others)


def broadcast_state_dict(comm, state_dict, src=0, *, max_bytes=None, check=True):
    """Pushes rank ``src``'s ``state_dict`` (or any ``(name, tensor)`` pairs) into every
    rank's own tensors, in place: fused calls of at most ``max_bytes`` each (default: one call
    for all, which needs no packing buffer), after :func:`check_layout` (``check=False``
    skips it, for a layout already checked). Every rank must call it.
    """
    items = list(state_dict.items()) if hasattr(state_dict, "items") else list(state_dict)
    if check:
        check_layout(comm, items, src)
    tensors = [t for _, t in items]
    for group in buckets(tensors, max_bytes):
        comm.broadcast_many(group, src)


def buckets(tensors, max_bytes):
    """Consecutive ``tensors`` grouped into lists of at most ``max_bytes`` bytes each (a
    larger tensor is a list of its own); ``None`` or 0: one list of them all (none when
    ``tensors`` is empty). What :func:`broadcast_state_dict` sends per fused call, and the
    buckets a packed broadcast fills."""
    if not max_bytes:
        return [tensors] if tensors else []
    out, cur, size = [], [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += n
    if cur:
        out.append(cur)
    return out
