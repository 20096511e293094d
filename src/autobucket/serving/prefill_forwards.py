"""Which of an admission's prefills share one forward.

Under a batch-invariant kernel set (the engine's, `kernels="invariant"` or where `"auto"` takes it) every
token's K/V and logits are bitwise the same whatever else a forward holds: several contexts packed in one
row (`packed_prefill.py`, each prompt's attention its own segment) or padded rows of a continued prefill
give each context exactly what a forward of it alone gives. With the model's own kernels a GEMM's
reduction order depends on how many rows it holds, so each context keeps a forward of its own, as the
engine did before packing: its tokens then do not depend on what else was admitted with it."""

from __future__ import annotations

from collections.abc import Sequence


def forward_batches(lengths: Sequence[int], together: bool, budget: int | None, padded: bool = False) -> list[list[int]]:
    """Consecutive indices of `lengths` (tokens each) per forward: as many as fit `budget` tokens when
    `together` (one longer than the budget alone), else one each. padded: a forward's rows are padded to
    its longest (a continued prefill), so a batch costs rows x longest tokens; else the sum (packed)."""
    if not together:
        return [[index] for index in range(len(lengths))]
    batches: list[list[int]] = []
    for index, length in enumerate(lengths):
        if batches and (budget is None or _tokens([*(lengths[i] for i in batches[-1]), length], padded) <= budget):
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def _tokens(lengths: list[int], padded: bool) -> int:
    return len(lengths) * max(lengths) if padded else sum(lengths)
