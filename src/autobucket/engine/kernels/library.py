"""The engine's C++ kernel library (`csrc/`): built for this machine at first use and loaded into
`torch.ops.autobucket`.

Every kernel of `kernels="invariant"` lives in one library (the attention, the fixed-order linear, the
fused elementwise ops, the sampler, the first argmax, the trainer's logprob reductions). It is compiled
with the machine's own instruction set at first use (`torch.utils.cpp_extension`, a minute or more on
a small machine, cached by source, flags, torch version and CPU flags in torch's extension folder).
`load_invariant_kernels` builds and loads it or raises a ValueError naming the fix;
`kernel_library_builds` answers whether it does, for callers with a fallback computing the same values."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "invariant_attention.cpp",
        "fixed_order_linear.cpp",
        "rotary.cpp",
        "silu_and_mul.cpp",
        "rms_norm.cpp",
        "first_argmax.cpp",
        "sample_inverse_cdf.cpp",
        "trainer_logprobs.cpp",
    )
]
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_vendor.h", "lanes.h", "aten_sum.h", "balanced_parallel.h")]  # in the build's digest: an edit rebuilds


# never reassociate a sum, never fuse a multiply into an add the source did not write (both score forms of
# the vector kernel must round the same sums the same way)
BUILD_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-fast-math", "-ffp-contract=off"]
# at::parallel_for is ATen's OpenMP loop, inlined from its headers: without -fopenmp it runs on one thread
# (so the kernels would not gain from threads as torch's own ops do). With it, the loops split among torch's threads (`torch.set_num_threads`) through the
# OpenMP runtime torch already loaded (libgomp.so.1, one runtime in the process). Every kernel's values are
# independent of how its loop is split, so threads change its speed only.
PARALLEL_FLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def load_invariant_kernels() -> None:
    """Build (once per machine kind, cached on disk) and load the kernel library into `torch.ops.autobucket`.

    With OpenMP where the compiler has it; a toolchain without it (no libgomp to link) gets a build whose
    loops run on one thread, warned once. Raises ValueError naming the fix when no C++ toolchain can build it."""
    try:
        _build_and_load(PARALLEL_FLAGS)
        return
    except (OSError, RuntimeError) as error:  # no compiler / ninja (OSError), a failed build (RuntimeError)
        parallel_error = error
    try:
        _build_and_load([])
    except (OSError, RuntimeError) as error:
        last_line = (str(error).strip().splitlines() or [""])[-1]
        raise ValueError(
            "kernels='invariant' builds its attention kernel with a C++ compiler at first use, and the build "
            f"failed ({type(error).__name__}: {last_line}); install g++ and ninja, or use RolloutConfig(kernels='torch')"
        ) from error
    last_line = (str(parallel_error).strip().splitlines() or [""])[-1]
    warnings.warn(
        f"autobucket: the kernel library did not build with OpenMP ({last_line}); its kernels run on one thread "
        "whatever torch.set_num_threads says (install the compiler's OpenMP runtime, libgomp, for them to split)",
        RuntimeWarning,
        stacklevel=2,
    )


def _build_and_load(parallel_flags: list[str]) -> None:
    flags = [*BUILD_FLAGS, *parallel_flags]
    sources = {path.name: path.read_text() for path in (*_SOURCES, *_HEADERS)}
    digest = hashlib.sha256(f"{sorted(sources.items())}|{flags}|{torch.__version__}|{_cpu_flags()}".encode()).hexdigest()[:12]
    name = f"autobucket_kernels_{digest}"
    from torch.utils import cpp_extension

    # ninja's build file names the sources by path, so building from wherever this package is installed
    # (a second checkout, a symlinked venv) would rebuild; a copy named by the digest is one path per build
    source_dir = _copy_sources(Path(cpp_extension._get_build_directory(name, verbose=False)).parent / f"{name}_src", sources)
    cpp_extension.load(
        name=name,
        sources=[str(source_dir / path.name) for path in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=parallel_flags,
        is_python_module=False,
        verbose=False,
    )


def _copy_sources(folder: Path, sources: dict[str, str]) -> Path:
    """Write the sources into `folder` once (same digest, same text); a partial copy from a process that
    died is completed, and a file is replaced atomically so a concurrent build never reads half of it."""
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, text in sources.items():
        target = folder / file_name
        if target.exists() and target.read_text() == text:
            continue
        temporary = folder / f".{file_name}.{os.getpid()}.tmp"
        temporary.write_text(text)
        os.replace(temporary, target)
    return folder


@functools.cache
def kernel_library_builds() -> bool:
    """Whether the engine's kernel library builds here (g++ and ninja), for callers that have a fallback
    computing the same values (the build error itself reaches the attention's callers)."""
    try:
        load_invariant_kernels()
    except ValueError:
        return False
    return True
