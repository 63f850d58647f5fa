"""Force one CPU kernel path for the whole process, so each path's tests run on any machine that can run it.

The engine picks its CPU kernels by what the CPU reports (``engine.platform``): AMX-INT8 tiles, the
AVX-512 VNNI kernels (fused W8A8 epilogues, the weight-only INT8 GEMV, the one-call decoder), oneDNN's
own int8 and bf16 ops, or plain torch ops. ``force_cpu_kernel_path`` holds every kernel above the chosen
path off (``NativeKernels.forbid``): a later ``enable(True)`` does not bring it back.

=========  ==============================================================================
path       what runs
=========  ==============================================================================
auto       what the CPU supports (the default)
amx        everything, AMX-INT8 for W8A8 (the CPU must report ``amx_int8``)
vnni       everything but AMX: the fused W8A8 kernels and the INT8 GEMV
onednn     the engine's C++ kernels; INT8 layers on oneDNN / ATen ops (no lmforge INT8 kernels)
torch      plain torch ops everywhere (no lmforge C++ kernel)
=========  ==============================================================================
"""

from __future__ import annotations

from engine import cpu_ops
from engine.errors import UsageError
from engine.platform import cpu_flags
from engine.quant import int8

CPU_KERNEL_PATHS = ("auto", "amx", "vnni", "onednn", "torch")

#: The kernel sets each path holds off.
_FORBIDDEN = {
    "auto": (),
    "amx": (),
    "vnni": ("amx",),
    "onednn": ("amx", "fused", "gemv", "decode"),
    "torch": ("amx", "fused", "gemv", "decode", "engine", "float_gemv"),
}


def _kernels() -> dict:
    return {
        "amx": int8._AMX,
        "fused": int8._FUSED,
        "gemv": int8._GEMV,
        "decode": cpu_ops.DECODE_KERNELS,
        "engine": cpu_ops.KERNELS,
        "float_gemv": cpu_ops.FLOAT_GEMV_KERNELS,
    }


def force_cpu_kernel_path(path: str) -> None:
    """Hold every CPU kernel above ``path`` off for the rest of the process (``auto`` lifts a forced path).

    Raises:
        UsageError: ``path`` is not one of ``CPU_KERNEL_PATHS``, or is ``amx`` on a CPU without AMX-INT8.
    """
    if path not in CPU_KERNEL_PATHS:
        raise UsageError(f"cpu kernel path {path!r}; use one of {CPU_KERNEL_PATHS}")
    if path == "amx" and "amx_int8" not in cpu_flags():
        raise UsageError("cpu kernel path 'amx' needs a CPU with AMX-INT8 (amx_int8 in /proc/cpuinfo)")
    _forced[0] = path
    for name, kernels in _kernels().items():
        if name in _FORBIDDEN[path]:
            kernels.forbid(f"cpu kernel path {path!r}")
        else:
            kernels.allow()


def forced_cpu_kernel_path() -> str:
    """The path ``force_cpu_kernel_path`` set last (``auto`` when none)."""
    return _forced[0]


_forced = ["auto"]
