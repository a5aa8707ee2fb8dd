"""How the OpenMP runtime's idle threads wait between parallel regions, and a warning where they sleep.

Every native op and every Inductor kernel of a decode step is a parallel region: a Llama-3.2-1B step runs ~130
of them, a few to a few hundred microseconds apart. Between regions the runtime's worker threads spin for a while
and then sleep; a sleeping thread is woken through the kernel at the next region. With spinning (the default:
GNU libgomp spins ~300k iterations, Intel's and LLVM's runtimes 200 ms) the workers are there when the next op
starts. Told to sleep at once (``OMP_WAIT_POLICY=passive``, ``GOMP_SPINCOUNT=0``, ``KMP_BLOCKTIME=0``), every
region pays a wake-up: on 2 Zen 4 cores under KVM, a 16-layer model's per-op cost went from ~2.0 to 5.2-6.9 ms a
step, and Llama-3.2-1B int8 decoded at 1.4-2.1x its memory floor instead of 1.0-1.15x (docs/PERFORMANCE.md,
thirty-ninth session). The runtimes read these variables once, when they load (with torch), so tilefx can only say
so.
"""

from __future__ import annotations

import dataclasses
import os
import re

# The OpenMP runtimes a torch build links: the file name /proc/self/maps shows, the runtime's name, and the variable
# of its own that set to 0 makes idle workers sleep at once. GNU (the PyPI wheels), Intel's (preloaded, or conda
# builds) and LLVM's.
_LIBRARIES = (("libgomp", "GNU libgomp", "GOMP_SPINCOUNT"), ("libiomp5", "Intel OpenMP", "KMP_BLOCKTIME"),
              ("libomp", "LLVM OpenMP", "KMP_BLOCKTIME"))


def loaded_runtime(maps_path: str = "/proc/self/maps") -> str | None:
    """The OpenMP runtime this process has loaded (a name from ``_LIBRARIES``), or None where none is found or the
    maps cannot be read (not Linux)."""
    try:
        with open(maps_path) as maps:
            files = {line.rsplit("/", 1)[-1].strip() for line in maps if "/" in line}
    except OSError:
        return None
    for prefix, name, _ in _LIBRARIES:  # libiomp5 before libomp: "libomp" is not a prefix of "libiomp5"
        if any(re.match(rf"{prefix}[-.]", f) for f in files):
            return name
    return None


@dataclasses.dataclass(frozen=True)
class IdleWait:
    runtime: str | None  # the loaded OpenMP runtime, None if unknown
    sleeps: str | None  # the setting that makes idle threads sleep at once, None where they spin

    def line(self) -> str:
        runtime = self.runtime or "OpenMP runtime not identified"
        if self.sleeps is None:
            return f"threads ({runtime}): idle workers spin between ops"
        return (f"threads ({runtime}): idle workers sleep between ops ({self.sleeps}): every op wakes them; "
                "unset it for decode")


def idle_wait(environ=None, runtime: str | None = "detect") -> IdleWait:
    """Whether this process's OpenMP workers sleep as soon as a parallel region ends, from the variables each runtime
    reads: ``OMP_WAIT_POLICY`` (all), ``GOMP_SPINCOUNT`` (GNU), ``KMP_BLOCKTIME`` (Intel, LLVM). ``runtime``: the
    loaded runtime's name (default: detected); with None every runtime's variables count."""
    environ = os.environ if environ is None else environ
    runtime = loaded_runtime() if runtime == "detect" else runtime
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return IdleWait(runtime, "OMP_WAIT_POLICY=passive")
    own = [variable for _, name, variable in _LIBRARIES if name == runtime]
    for name in own or [variable for _, _, variable in _LIBRARIES]:  # unknown runtime: every one's
        value = environ.get(name, "").strip()
        if value and re.fullmatch(r"0+(\.0*)?\s*(ms|us)?", value, re.IGNORECASE):
            return IdleWait(runtime, f"{name}={value}")
    return IdleWait(runtime, None)


def warning(wait: IdleWait) -> str | None:
    """What compile_model warns where the workers sleep, or None."""
    if wait.sleeps is None:
        return None
    return (f"tilefx: {wait.sleeps} makes the OpenMP workers sleep after every parallel region, and a decode step "
            "runs one per op: each op then waits for its threads to wake (on 2 cores, ~3.5 ms more a step for a "
            "16-layer model, up to 2x the memory floor for Llama-3.2-1B int8). Unset it before the process starts (the "
            "runtime reads it once, with torch's import); tilefx.explain() says how the threads wait")
