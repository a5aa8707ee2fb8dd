"""Collectives for tensor-parallel ranks: ``tilefx.all_reduce`` and ``tilefx.all_gather``.

The ops name a group (a string: graphs and their cache keys stay the same across
processes); ``open_group`` binds the name to a communicator in this process:

- ``ShmCommunicator``: ranks on one host. Each rank creates one segment file in
  ``/dev/shm`` (``tilefx-<run id>-<rank>``, the run id drawn by rank 0: two engines on
  one host never collide), every rank maps all of them (csrc/collectives.cpp moves the
  bytes: fp32 sums in rank order, two slots so no trailing barrier, a dead or hung
  peer named within a bound), then each rank unlinks its own file: the memory goes
  away with the last process that maps it, whatever way the processes exit.
- ``GlooCommunicator``: ranks on several hosts, through ``torch.distributed`` (gloo),
  fp32 sums; also the reference the shared-memory one is tested against.

Both are opaque to Inductor (custom ops without aliasing or mutation: one extern call
each, no graph break).
"""

from __future__ import annotations

import atexit
import os
import time
import uuid

import torch
import torch.distributed as dist

from tilefx.custom_ops import isa

TP_GROUP = "tilefx-tp"  # the group compile_model(..., tp=N) opens and its graphs name
_GROUPS: dict[str, "ShmCommunicator | GlooCommunicator"] = {}
SLOT_BYTES = 8 << 20  # per rank and slot: larger tensors take several steps


class ShmCommunicator:
    kind = "shm"

    def __init__(self, process_group, timeout_s: float, slot_bytes: int = SLOT_BYTES, directory: str = "/dev/shm"):
        if isa.native is None:
            raise RuntimeError("shared-memory collectives need tilefx's native extension (not built)")
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        run = [uuid.uuid4().hex[:16] if self.rank == 0 else None]
        dist.broadcast_object_list(run, src=dist.get_global_rank(process_group, 0), group=process_group)
        paths = [os.path.join(directory, f"tilefx-{run[0]}-{r}") for r in range(self.world_size)]
        own = paths[self.rank]
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 4096 + 2 * slot_bytes)  # csrc/collectives.cpp: header page + two slots
        finally:
            os.close(fd)
        try:
            dist.barrier(group=process_group)  # every file exists
            self.handle = isa.native.shm_open_group(paths, self.rank, slot_bytes, timeout_s)
            dist.barrier(group=process_group)  # every rank mapped every file
        finally:
            os.unlink(own)
        self.paths = paths

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return isa.native.shm_all_reduce(self.handle, x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return isa.native.shm_all_gather(self.handle, x)

    def stats(self) -> dict:
        calls, seconds, waiting = isa.native.shm_stats(self.handle)
        return {"calls": calls, "seconds": seconds, "wait_seconds": waiting}

    def close(self) -> None:
        isa.native.shm_close_group(self.handle)


class GlooCommunicator:
    kind = "gloo"

    def __init__(self, process_group):
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.calls, self.seconds = 0, 0.0
        # The last exchange's tensors, kept until the next one starts. Gloo's worker thread drops its references
        # to a collective's tensors just after the caller sees it done; where the tensors' Python objects died
        # first, that thread needs the GIL to free them, and a thread that gets it only once the interpreter is
        # finalizing (the last collective before exit) aborts the process. Kept here, they die on this thread.
        self._exchanged: tuple = ()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._exchanged = ()
        start = time.perf_counter()
        total = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(total, group=self.group)
        self._exchanged = (total,)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._exchanged = ()
        start = time.perf_counter()
        parts, mine = [torch.empty_like(x) for _ in range(self.world_size)], x.contiguous()
        dist.all_gather(parts, mine, group=self.group)
        self._exchanged = (*parts, mine)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def stats(self) -> dict:
        return {"calls": self.calls, "seconds": self.seconds, "wait_seconds": None}

    def close(self) -> None:
        self._exchanged, self.group = (), None


def open_group(name: str, kind: str, process_group=None, timeout_s: float = 300.0):
    """Bind group ``name`` to a new communicator of ``kind`` (``shm`` or ``gloo``) over ``process_group`` (default:
    the world). Every rank calls it, in the same order."""
    if name in _GROUPS:
        raise ValueError(f"collective group {name!r} is already open in this process")
    group = process_group if process_group is not None else dist.group.WORLD
    if kind == "shm":
        _GROUPS[name] = ShmCommunicator(group, timeout_s)
        isa.native.shm_name_group(name, _GROUPS[name].handle)  # the ops' C++ kernel serves it directly
    elif kind == "gloo":
        _GROUPS[name] = GlooCommunicator(group)
    else:
        raise ValueError(f"collective kind {kind!r}: expected 'shm' or 'gloo'")
    return _GROUPS[name]


def group(name: str):
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(f"no collective group {name!r} open in this process (compile_model(..., tp=N) opens "
                           f"{name!r})") from None


def close_group(name: str) -> None:
    communicator = _GROUPS.pop(name, None)
    if communicator is not None:
        communicator.close()


@atexit.register
def close_all_groups() -> None:
    """Close every open group. Run at exit, before the interpreter finalizes, while any thread can still take the
    GIL. A gloo communicator holds its process group, so ``dist.destroy_process_group()`` does not end the C++
    group while the communicator lives. Held to finalization, the group's worker threads were destroyed there, where
    one that needs the GIL (to free a tensor with a Python object: pytorch/pytorch#179291) aborts the process. That
    is the likely cause, not reproduced, of tests/test_tp.py's gloo run dying at exit twice ("terminate called
    without an active exception", in CI and in a fresh clone)."""
    for name in list(_GROUPS):
        close_group(name)


def _all_reduce_in_python(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return group(group_name).all_reduce(x)


def _all_gather_in_python(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    gathered = group(group_name).all_gather(x)
    return gathered if gathered.shape[-1] == size else gathered[..., :size].contiguous()


@torch.library.custom_op("tilefx::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of group ``group_name`` (fp32 sums; every rank gets the same bits)."""
    return _all_reduce_in_python(x, group_name)


@all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tilefx::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """The ranks' ``x [..., L]`` side by side along the last dim, cut to ``size`` (``<= ranks * L``): the full
    vocabulary from each rank's rows of it, the last rank's padding dropped."""
    return _all_gather_in_python(x, group_name, size)


@all_gather.register_fake
def _(x, group_name, size):
    return x.new_empty((*x.shape[:-1], size))


# The ops' CPU kernel (csrc/collectives.cpp, registered with the other native kernels) runs a shared-memory group
# without Python (for a decode-sized tensor a Python custom op's dispatch costs more than the exchange itself) and
# calls these for the others.
if isa.native is not None:
    isa.native.set_collective_fallbacks(_all_reduce_in_python, _all_gather_in_python)
