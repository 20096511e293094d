"""What attention_ab.py, linear_ab.py and decode_attention.py share: a git revision's kernel source (or this
tree's, with build-time defines) built beside this tree's library under its own operator namespace, and
this tree's op timed against it in one process."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import interleaved

from autobucket.engine.kernels.library import BUILD_FLAGS, PARALLEL_FLAGS

CSRC = "src/autobucket/engine/kernels/csrc"


def build_revision_kernel(revision: str, source: str, namespace: str) -> None:
    """`source` (a file of csrc/, with the headers of csrc/ it includes) as `revision` had it, its operators
    registered under `namespace` (its TORCH_LIBRARY or TORCH_LIBRARY_FRAGMENT becomes that namespace's library)."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    commit = subprocess.check_output(["git", "rev-parse", revision], cwd=root, text=True).strip()
    folder = Path(tempfile.mkdtemp(prefix=f"{namespace}_"))
    text = subprocess.check_output(["git", "show", f"{commit}:{CSRC}/{source}"], cwd=root, text=True)
    for header in re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE):
        included = subprocess.check_output(["git", "show", f"{commit}:{CSRC}/{header}"], cwd=root, text=True)
        (folder / header).write_text(included)
    _build(folder, source, text, f"{namespace}_{commit[:12]}", namespace)


def build_tree_kernel(source: str, namespace: str, defines: dict[str, int]) -> None:
    """`source` (a file of csrc/) as this tree has it, each of `defines` set before its first line (as
    `AUTOBUCKET_DECODE_PREFETCH` fixes a choice the library makes by CPU), its operators registered under
    `namespace`; it includes this tree's headers."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    folder = Path(tempfile.mkdtemp(prefix=f"{namespace}_"))
    for header in (root / CSRC).glob("*.h"):
        (folder / header.name).write_text(header.read_text())
    text = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + (root / CSRC / source).read_text()
    _build(folder, source, text, namespace, namespace)


def _build(folder: Path, source: str, text: str, name: str, namespace: str) -> None:
    """`text` written as `folder/source` with its TORCH_LIBRARY blocks moved to `namespace`, built and loaded."""
    text = re.sub(r"TORCH_LIBRARY(?:_FRAGMENT)?\(autobucket\b", f"TORCH_LIBRARY({namespace}", text)
    text = re.sub(r"TORCH_LIBRARY_IMPL\(autobucket\b", f"TORCH_LIBRARY_IMPL({namespace}", text)
    (folder / source).write_text(text)
    from torch.utils import cpp_extension

    # with OpenMP as the library is built (since 86764aa), so that both builds split their loops alike
    cpp_extension.load(name=name, sources=[str(folder / source)],
                       extra_cflags=[*BUILD_FLAGS, *PARALLEL_FLAGS], extra_ldflags=PARALLEL_FLAGS,
                       is_python_module=False, verbose=False)  # fmt: skip


def _outputs_equal(tree, baseline) -> bool:
    if isinstance(tree, torch.Tensor):
        return torch.equal(tree, baseline)
    return all(torch.equal(a, b) for a, b in zip(tree, baseline, strict=True))


def tree_against_baseline(
    functions: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> dict:
    """`functions` {"tree", "baseline"} (each returning a tensor or a list of them): whether their outputs
    are bitwise equal, then interleaved samples, medians and the ratio tree / baseline."""
    equal = _outputs_equal(functions["tree"](), functions["baseline"]())
    samples = interleaved(functions, repeats, before=before)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"medians_ms": medians, "samples_ms": samples, "bitwise_equal": equal,
            "ratio_tree_to_baseline": medians["tree"] / medians["baseline"]}  # fmt: skip
