"""Where a tensor-parallel rank runs: its cores and its memory, before it loads anything.

Decode reads every weight once per token, so a rank should read only memory its own
NUMA node holds. ``cpus_for`` reads the nodes from ``/sys/devices/system/node``:
with at least as many nodes as ranks on the host, local rank r gets node
``r % nodes``'s CPUs (those this process may use) and its memory; with fewer nodes
(one, on most desktops and on this project's test machines), the CPUs the process
may use are cut into one contiguous slice per rank and memory is left to the kernel.
``TILEFX_CPU_BIND`` overrides it: one CPU list per local rank separated by ``|``
(``"0-31|32-63"``), as SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` and vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` do.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib

import torch
import torch._inductor.config

NODES = pathlib.Path("/sys/devices/system/node")
_MPOL_BIND = 2
_SYS_SET_MEMPOLICY = 238  # x86-64
_started_with: list[int] | None = None  # the CPUs this process could use before bind() narrowed them


@dataclasses.dataclass(frozen=True)
class Placement:
    cpus: tuple[int, ...]
    node: int | None  # the NUMA node whose memory the rank binds to (None: the kernel's default policy)
    how: str  # where the choice came from, for the log

    def describe(self) -> str:
        """``"cpus 0-31 (NUMA node 0)"``: for the log and ``tilefx.explain``."""
        return f"cpus {format_cpu_list(self.cpus)} ({self.how})"


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            cpus.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is neither N nor N-M") from None
    return cpus


def format_cpu_list(cpus) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``: ``parse_cpu_list``'s inverse."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def numa_nodes(root: pathlib.Path = NODES) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs ({} where the kernel does not say)."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*")):
        cpulist = path / "cpulist"
        if cpulist.exists():
            cpus = parse_cpu_list(cpulist.read_text())
            if cpus:
                nodes[int(path.name[4:])] = cpus
    return nodes


def cpus_for(local_rank: int, local_world_size: int, available: list[int], nodes: dict[int, list[int]],
             override: str | None = None) -> Placement:
    """The placement of local rank ``local_rank`` of ``local_world_size`` on this host."""
    if override:
        lists = override.split("|")
        if len(lists) != local_world_size:
            raise ValueError(f"TILEFX_CPU_BIND={override!r} names {len(lists)} CPU lists for {local_world_size} "
                             f"ranks on this host (one per rank, separated by '|')")
        cpus = parse_cpu_list(lists[local_rank])
        if not cpus:
            raise ValueError(f"TILEFX_CPU_BIND={override!r}: rank {local_rank}'s CPU list is empty")
        node = next((n for n, node_cpus in nodes.items() if set(cpus) <= set(node_cpus)), None)
        return Placement(tuple(cpus), node if len(nodes) > 1 else None, "TILEFX_CPU_BIND")
    if len(nodes) >= local_world_size > 0 and len(nodes) > 1:
        node = sorted(nodes)[local_rank % len(nodes)]
        cpus = [c for c in nodes[node] if c in set(available)] or list(nodes[node])
        return Placement(tuple(cpus), node, f"NUMA node {node}")
    if len(available) < local_world_size:
        raise ValueError(f"{local_world_size} ranks on this host but this process may use {len(available)} CPU(s): "
                         f"give each rank at least one (TILEFX_CPU_BIND)")
    per_rank = len(available) // local_world_size
    cpus = sorted(available)[local_rank * per_rank: (local_rank + 1) * per_rank]
    return Placement(tuple(cpus), None, f"slice {local_rank + 1} of {local_world_size} of this process's CPUs")


def bind(local_rank: int, local_world_size: int) -> Placement:
    """Pin this process (and the threads it starts) to its placement; bind its memory to the node where there
    are several. Returns the placement."""
    global _started_with
    if _started_with is None:  # a second model in this process is placed from the same CPUs, not the first's
        _started_with = sorted(os.sched_getaffinity(0))
    placement = cpus_for(local_rank, local_world_size, _started_with, numa_nodes(), os.environ.get("TILEFX_CPU_BIND"))
    os.sched_setaffinity(0, placement.cpus)
    torch.set_num_threads(len(placement.cpus))
    # Inductor compiles C++ in a pool of min(32, CPUs) worker processes, the count taken when its config was
    # imported: every rank's pool sized to the whole host, all compiling at once. Each rank's pool is sized to its
    # own CPUs instead (one CPU: compiled in the rank's process, no pool), unless the user set its size.
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        torch._inductor.config.compile_threads = min(32, len(placement.cpus))
    if placement.node is not None:
        _bind_memory(placement.node)
    return placement


def _bind_memory(node: int) -> None:
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_SET_MEMPOLICY, _MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2)) != 0:
        raise OSError(ctypes.get_errno(), f"set_mempolicy(MPOL_BIND, node {node}) failed")
