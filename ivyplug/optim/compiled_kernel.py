"""The compiled LAMB step (``lamb_kernel.c``): built on first use with the system C compiler, loaded with ctypes.

A speed path, not a feature: installing ivyplug needs no compiler. When none is found, or the build fails, the
pure-torch kernels run instead and one warning says why (:func:`load`). The C source has no torch headers, so a
build takes about a second; the shared library is cached per user, keyed by a hash of the source, the compiler,
its flags and the machine (``-march=native``: it is built where it runs), and written atomically (temporary file,
then rename), so concurrent processes never load a half-written library.

Selection: ``IVYPLUG_LAMB_KERNEL`` (:data:`KERNEL_ENV`) = ``auto`` (default: compiled when it builds, else torch),
``torch`` (never compile) or ``compiled`` (required: an error when it cannot be built), or the ``kernel=``
argument of :func:`ivyplug.optim.functional.lamb`. ``CC`` names the compiler (default: ``cc``, ``gcc`` or
``clang`` on ``PATH``); the cache lives in ``$XDG_CACHE_HOME/ivyplug`` (default ``~/.cache/ivyplug``).

ctypes releases the GIL for the call. The kernel's threads are the process's OpenMP team (torch's, looked up in the
process, never loaded: its workers are the ones spinning on the cores after torch's last parallel op), else
pthreads of its own; :meth:`CompiledKernel.openmp_threads` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from ivyplug.optim.lamb_hyper import LambHyper

__all__ = [
    "KERNEL_CHOICES",
    "KERNEL_ENV",
    "CompiledKernel",
    "cache_dir",
    "kernel_choice",
    "load",
    "reset",
    "unavailable_reason",
]

KERNEL_ENV = "IVYPLUG_LAMB_KERNEL"
KERNEL_CHOICES = ("auto", "torch", "compiled")
SOURCE = Path(__file__).with_name("lamb_kernel.c")
#: Compiler flags, tried in order (the first set that builds wins): native code first, then portable code.
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c11", "-fPIC", "-shared", "-pthread"),
    ("-O3", "-fno-math-errno", "-std=c11", "-fPIC", "-shared", "-pthread"),
)
#: Libraries, after the source: dlopen/dlsym (part of libc since glibc 2.34, in libdl before; the kernel looks up
#: the process's OpenMP runtime with them).
LIBS: tuple[str, ...] = ("-ldl",) if sys.platform.startswith("linux") else ()
#: Seconds a compiler run may take before it counts as a failed build.
COMPILE_TIMEOUT_S = 120.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "kernel": CompiledKernel, or "reason": why there is none


def kernel_choice(kernel: str | None = None) -> str:
    """``kernel`` if given, else ``IVYPLUG_LAMB_KERNEL`` (default ``auto``); ValueError naming the bad value."""
    value = kernel if kernel is not None else os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        source = "kernel" if kernel is not None else KERNEL_ENV
        raise ValueError(f"{source} must be one of {', '.join(KERNEL_CHOICES)}, got {value!r}")
    return value


class CompiledKernel:
    """The loaded library: :meth:`lamb` and :meth:`sumsq` over lists of contiguous float32 CPU tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64, f64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        lib.ivy_lamb_f32.argtypes = [i64, p, p, p, p, p, p, f64, f64, f64, f64, f64, cint, cint, f64, f64, f64, cint,
                                     i64, i64, i64, p, i64, p]  # fmt: skip
        lib.ivy_lamb_f32.restype = cint
        lib.ivy_sumsq_f32.argtypes = [i64, p, p, cint, i64, i64, i64]
        lib.ivy_sumsq_f32.restype = f64
        lib.ivy_openmp_threads.argtypes = []
        lib.ivy_openmp_threads.restype = cint
        lib.ivy_allow_openmp.argtypes = [cint]
        lib.ivy_allow_openmp.restype = None
        self._lib = lib
        self.path = path

    def openmp_threads(self) -> bool:
        """Whether the kernel runs on the process's OpenMP team (True) or on pthreads of its own (False)."""
        return bool(self._lib.ivy_openmp_threads())

    def allow_openmp(self, allow: bool) -> None:
        """Use the OpenMP team when there is one (the default), or always pthreads (tests, comparisons)."""
        self._lib.ivy_allow_openmp(int(allow))

    def lamb(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        exp_avgs: Sequence[Tensor],
        exp_avg_sqs: Sequence[Tensor],
        steps: Sequence[Tensor],
        h: LambHyper,
        *,
        threads: int,
        split_min: int,
        block: int,
        parallel_min: int = 0,
        scratch: Tensor | None = None,
    ) -> list[float] | None:
        """One step in place (steps incremented); the trust ratios, or None (nothing changed) when buffers overlap.

        The caller guarantees float32, CPU, contiguous tensors of matching sizes and 0-dim float32 step counters.
        ``scratch`` (contiguous float32, one part per thread) keeps the update of a thread's blocks between the two
        passes while there is room, instead of recomputing it from the moments.
        """
        n = len(params)
        ptrs = ctypes.c_void_p * n
        ratios = (ctypes.c_double * n)()
        rc = self._lib.ivy_lamb_f32(
            n,
            ptrs(*[t.data_ptr() for t in params]),
            ptrs(*[t.data_ptr() for t in grads]),
            ptrs(*[t.data_ptr() for t in exp_avgs]),
            ptrs(*[t.data_ptr() for t in exp_avg_sqs]),
            ptrs(*[t.data_ptr() for t in steps]),
            (ctypes.c_int64 * n)(*[t.numel() for t in params]),
            h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, int(h.bias_correction), int(h.adapt), h.min_trust_ratio,
            h.max_trust_ratio, h.grad_scale, threads, split_min, parallel_min, block,
            None if scratch is None else scratch.data_ptr(), 0 if scratch is None else scratch.numel(), ratios,
        )  # fmt: skip
        if rc == -2:
            return None
        if rc < 0:
            raise MemoryError("the compiled LAMB kernel could not allocate its bookkeeping")
        return list(ratios)

    def sumsq(
        self, tensors: Sequence[Tensor], *, threads: int, split_min: int, block: int, parallel_min: int = 0
    ) -> float:
        """``Σ‖t‖²`` accumulated in double; NaN/Inf elements give a non-finite result."""
        n = len(tensors)
        total = float(
            self._lib.ivy_sumsq_f32(
                n,
                (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors]),
                (ctypes.c_int64 * n)(*[t.numel() for t in tensors]),
                threads,
                split_min,
                parallel_min,
                block,
            )
        )
        if total < 0.0:
            raise MemoryError("the compiled gradient-norm kernel could not allocate its block sums")
        return total


def _compiler() -> list[str] | None:
    """The compiler command: ``CC`` if set (may carry arguments), else the first of cc/gcc/clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        words = shlex.split(cc)
        found = shutil.which(words[0])
        return [found, *words[1:]] if found else None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _machine_id() -> str:
    """What a ``-march=native`` build depends on: the architecture and, on Linux, the CPU's feature flags."""
    parts = [sys.platform, platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    parts.append(line.strip())
                if line.strip() == "":
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/ivyplug``, default ``~/.cache/ivyplug``."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return Path(base) / "ivyplug" if base else Path.home() / ".cache" / "ivyplug"


def _library_path(directory: Path, compiler: list[str], flags: Sequence[str], source: bytes) -> Path:
    try:
        stat = os.stat(compiler[0])
        compiler_id = f"{compiler}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        compiler_id = str(compiler)
    digest = hashlib.sha256(
        b"\0".join([source, compiler_id.encode(), " ".join([*flags, *LIBS]).encode(), _machine_id().encode()])
    ).hexdigest()[:24]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    return directory / f"lamb_kernel-{digest}{suffix}"


def _build(compiler: list[str], flags: Sequence[str], target: Path) -> str | None:
    """Compile into a temporary file next to ``target``, then rename it there. Returns an error, or None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*compiler, *flags, "-o", tmp, str(SOURCE), *LIBS],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return f"{Path(compiler[0]).name} exited with {proc.returncode}: {lines[-1] if lines else 'no output'}"
        os.replace(tmp, target)
        return None
    except subprocess.TimeoutExpired:
        return f"{Path(compiler[0]).name} took more than {COMPILE_TIMEOUT_S:.0f} s"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dirs() -> list[Path]:
    """The user cache, then a per-user temporary directory (for a read-only or full home)."""
    user = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return [cache_dir(), Path(tempfile.gettempdir()) / f"ivyplug-{user}"]


def _load_or_build() -> CompiledKernel | str:
    """The kernel, from the cache or freshly built; or the reason there is none."""
    compiler = _compiler()
    if compiler is None:
        cc = os.environ.get("CC", "").strip()
        return f"the C compiler {cc!r} (CC) was not found" if cc else "no C compiler (cc, gcc, clang) on PATH"
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return f"the kernel source {SOURCE.name} is missing from the installed package ({exc.strerror})"
    errors: list[str] = []
    for directory in _cache_dirs():
        for flags in FLAG_SETS:
            target = _library_path(directory, compiler, flags, source)
            try:
                if target.exists():
                    try:
                        return CompiledKernel(target)
                    except OSError as exc:  # a corrupt cached library (e.g. written to a full disk): rebuild it
                        errors.append(f"cached library did not load ({exc})")
                        target.unlink(missing_ok=True)
                error = _build(compiler, flags, target)
                if error is None:
                    return CompiledKernel(target)
                errors.append(error)
            except OSError as exc:  # the directory is not writable, or a fresh library does not load
                errors.append(f"{type(exc).__name__}: {exc}")
                break
        else:
            break  # every flag set failed to compile: another directory would not help
    return "; ".join(dict.fromkeys(errors)) or "the build failed"


def load(required: bool = False) -> CompiledKernel | None:
    """The compiled kernel, built at the first call of the process; None (warned once) when it cannot be had.

    With ``required`` a missing kernel raises RuntimeError with the reason instead.
    """
    kernel = _state.get("kernel")
    if kernel is None and "reason" not in _state:
        with _lock:
            if "kernel" not in _state and "reason" not in _state:
                result = _load_or_build()
                if isinstance(result, CompiledKernel):
                    _state["kernel"] = result
                else:
                    _state["reason"] = result
                    _log.warning(
                        "ivyplug: the compiled LAMB kernel is not available (%s); using the torch kernel", result
                    )
        kernel = _state.get("kernel")
    if kernel is None and required:
        raise RuntimeError(f"{KERNEL_ENV}=compiled, but the compiled LAMB kernel is not available: {_state['reason']}")
    return kernel if isinstance(kernel, CompiledKernel) else None


def unavailable_reason() -> str | None:
    """Why :func:`load` gave None in this process (None when it loaded or was not tried yet)."""
    reason = _state.get("reason")
    return reason if isinstance(reason, str) else None


def reset() -> None:
    """Forget the loaded kernel or the failure, so the next :func:`load` tries again (tests, a fixed compiler)."""
    with _lock:
        _state.clear()
