"""The GPU kernel set of `kernels="invariant"`: batch-invariant Triton kernels registered as torch custom ops
(so CUDA graphs and `torch.compile` capture them as single calls).

- `linear.py`: a GEMM with fixed tiles per dtype for every row count, K walked in order, no split-K, the
  weight read in place, the bias added after the K loop;
- `attention.py`: one attention kernel over the static cache (decode, packed and chunked prefill, windows):
  each query walks its own allowed keys in blocks counted from its first allowed key;
- `shared_prefix_attention.py`: decode attention where rows read a shared prefix's one K/V copy, then their
  own columns, as one sequence: bitwise `attention.py` over the row's whole sequence;
- `row_reductions.py`: RMSNorm and logsumexp / log_softmax, one program per row;
- `selection.py`: greedy and inverse-CDF selection on the device;
- `scope.py`: the scope that routes a forward's linears and attention to them;
- `ahead_of_time.py`: every kernel compiled for a GPU target without a GPU (CI's check).

triton is optional: `available()` says whether it imports; nothing here imports it at package import."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def available() -> bool:
    """Whether triton is installed (the kernel modules import it)."""
    return importlib.util.find_spec("triton") is not None
