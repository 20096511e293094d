"""The continuous-batching decode step compiled with `torch.compile` over static shapes.

Why it can be static: the `StaticKVCache` is preallocated and right-aligned, so one decode step is
"write column `front` of every row, attend over columns `[0, front]`". The compiled step takes the
cache buffers sliced to a *column bucket* (a multiple of `COLUMN_STEP` covering `front + 1`), the
additive mask over the same columns, the position ids and the write column as a tensor; rows are
padded up to a *row bucket* (powers of two, plus the cache's row count). A call therefore reuses a
handful of graphs, and graphs survive across calls: they are cached per model, keyed by
(rows, columns, cache capacity) — the capacity is rounded up to a multiple of `COLUMN_STEP` so calls
of similar lengths share strides and graphs.

Padded rows feed the pad token at position 0 with every column masked; their logits are dropped and
the garbage they write lands in rows no active row reads (admission rewrites a row's columns and mask).

Weights are read live: the model's parameters are graph inputs, not constants, so an in-place
optimizer step changes the next call's tokens without a recompile. (Inductor's `freezing` would bake
them in as constants and return the old model's tokens; measured, see docs/benchmarks.md.)

Attention: under dynamo, transformers expands grouped K/V heads with `repeat_kv` (a full copy of the
cache every step, measured 2.6x slower than eager); here one decode token's query heads are grouped
onto their K/V head instead (`[rows, kv_heads, group, head_dim]`), so SDPA reads the cache in place.
That function is registered with transformers' `AttentionInterface` and selected only while a
compiled step runs.

Failures never raise: a model that does not trace, a graph limit, or a recompile storm disables the
compiled path for that model with a one-line warning and the reason in the profile; eager decoding
continues."""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from autobucket.engine.hf_compat import attention_swapped

COLUMN_STEP = 128  # column bucket granularity: attention over <= 127 masked columns, few graphs
MAX_GRAPHS_PER_MODEL = 24  # beyond this a new shape decodes eagerly (compile is tens of seconds each)
MAX_RECOMPILES_PER_MODEL = 4  # guard failures on an already compiled shape before giving up
ATTENTION_NAME = "autobucket_decode"


def row_bucket(rows: int, capacity_rows: int) -> int:
    """Smallest power of two >= rows, capped at the cache's row count."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, capacity_rows)


def column_bucket(columns: int, capacity: int) -> int:
    """Smallest multiple of COLUMN_STEP >= columns, capped at the cache capacity."""
    return min(-(-columns // COLUMN_STEP) * COLUMN_STEP, capacity)


def rounded_capacity(columns: int) -> int:
    return -(-columns // COLUMN_STEP) * COLUMN_STEP


def predicted_graph_keys(rows: int, longest: int, max_new_tokens: int, capacity: int) -> set[tuple[int, int, int]]:
    """The (rows, columns, capacity) graphs a call with full rows will visit (its tail may add smaller row buckets)."""
    capacity = rounded_capacity(capacity)
    first, last = column_bucket(longest + 1, capacity), column_bucket(longest + max_new_tokens, capacity)
    return {(row_bucket(rows, rows), c, capacity) for c in range(first, last + 1, COLUMN_STEP)}


# ------------------------------------------------------------------ attention used inside the graph
def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA for one query token per row without expanding K/V heads.

    query [rows, heads, 1, head_dim]; key, value [rows, kv_heads, columns, head_dim]; attention_mask
    [rows, 1, 1, columns] additive -> output [rows, 1, heads, head_dim] (transformers' layout)."""
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("the compiled decode step supports one-token plain (SDPA-style) attention only")
    rows, heads, _, head_dim = query.shape
    grouped = query.reshape(rows, key.shape[1], heads // key.shape[1], head_dim)
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(rows, 1, heads, head_dim), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, grouped_decode_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # never used: the step passes a 4-D mask


def _attention_swapped(model: torch.nn.Module):
    """Select the grouped decode attention for the duration of one compiled step."""
    return attention_swapped(model, ATTENTION_NAME)


# ------------------------------------------------------------------ the cache face inside the graph
class StepLayer(CacheLayerMixin):
    """One layer's face of a `StepCache` (transformers queries sizes per layer)."""

    is_sliding = False
    is_compileable = True

    def __init__(self, owner: StepCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_initialized = True

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.owner.keys[0].shape[2], 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0  # never read: position ids are always passed

    def get_max_length(self) -> int:
        return self.owner.keys[0].shape[2]

    def get_max_cache_shape(self) -> int:  # transformers 4.57 name
        return self.owner.keys[0].shape[2]


class StepCache(Cache):
    """transformers `Cache` that writes one decode column by index into bucket views (traceable, fixed shape)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor) -> None:
        super().__init__(layers=[StepLayer(self, layer) for layer in range(len(keys))])
        self.keys, self.values, self.column = keys, values, column

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # key_states [rows, kv_heads, 1, head_dim] -> column `column` of the bucket view, in place
        self.keys[layer_idx].index_copy_(2, self.column, key_states)
        self.values[layer_idx].index_copy_(2, self.column, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.keys[0].shape[2], 0

    def get_max_cache_shape(self, *args, **kwargs) -> int:
        return self.keys[0].shape[2]


def decode_step(model, cache_keyword, input_ids, position_ids, mask, column, keys, values):
    """The function compiled: input_ids, position_ids [rows, 1]; mask [rows, 1, 1, columns]; column [1];
    keys[l], values[l] [rows, kv_heads, columns, head_dim] -> logits [rows, vocab] fp32."""
    cache = StepCache(keys, values, column)
    output = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
        **{cache_keyword: cache},
    )  # fmt: skip
    return output.logits[:, -1, :].float()


# ------------------------------------------------------------------ graphs per model, across calls
@dataclass
class DecodeGraphs:
    """One model's compiled shapes; kept while the model lives, so later calls reuse its graphs."""

    shapes: set[tuple[int, int, int]] = field(default_factory=set)  # (rows, columns, capacity)
    recompiles: int = 0  # guard failures on an already compiled shape, over the model's lifetime
    disabled_reason: str = ""  # non-empty: this model decodes eagerly from now on


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED_STEP = None  # one torch.compile wrapper; dynamo keys its graphs by model and shapes


def decode_graphs(model: torch.nn.Module) -> DecodeGraphs:
    if model not in _GRAPHS:
        _GRAPHS[model] = DecodeGraphs()
    return _GRAPHS[model]


def _compiled_step():
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        _register_attention()
        _COMPILED_STEP = torch.compile(decode_step, dynamic=False, fullgraph=True)
    return _COMPILED_STEP


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@dataclass
class CompileStats:
    """What one call's compiled decode did (copied into its Profile)."""

    compile_ms: float = 0.0  # wall time of steps that compiled a graph (never counted as decode time)
    new_graphs: int = 0
    recompiles: int = 0  # unexpected: an already compiled shape compiled again
    compiled_steps: int = 0
    eager_steps: int = 0
    fallback_reason: str = ""


class CompiledDecode:
    """Runs a `ModelRunner`'s decode step through the model's compiled graphs, or says it cannot."""

    def __init__(
        self, model: torch.nn.Module, cache_keyword: str, allow_new_graphs: bool, round_capacity: bool = True
    ) -> None:
        self.model, self.cache_keyword, self.allow_new_graphs = model, cache_keyword, allow_new_graphs
        self.round_capacity = round_capacity  # False: an explicit cache_capacity is a memory limit, kept
        self.graphs = decode_graphs(model)
        self.stats = CompileStats(fallback_reason=self.graphs.disabled_reason)
        self.last_step_compiled = False  # the last step's time was compile time (kept out of step timings)

    def capacity(self, columns: int) -> int:
        """Cache columns to allocate: rounded up so calls of similar lengths share graphs."""
        return rounded_capacity(columns) if self.round_capacity else columns

    def step(self, runner) -> torch.Tensor | None:
        """Logits [active_rows, vocab] fp32 of one decode step, or None: decode this step eagerly."""
        store, graphs = runner.store, self.graphs
        rows, self.last_step_compiled = runner.active_rows, False
        key = (row_bucket(rows, store.rows), column_bucket(store.front + 1, store.columns), store.columns)
        new = key not in graphs.shapes
        if graphs.disabled_reason or (new and not self._may_compile(graphs)):
            self.stats.eager_steps += 1
            return None
        started, graphs_before = time.perf_counter(), _graph_count()
        try:
            with _attention_swapped(self.model), torch._dynamo.config.patch(recompile_limit=1 << 20):
                logits = _compiled_step()(self.model, self.cache_keyword, *self._inputs(runner, key))
        except (torch._dynamo.exc.TorchDynamoException, NotImplementedError) as error:
            self._disable(f"{type(error).__name__}: {_first_line(error)}")
            self.stats.eager_steps += 1
            return None
        except Exception as error:  # noqa: BLE001 - e.g. the model's own error: the eager step shows it
            self.stats.fallback_reason = f"step failed, ran eagerly: {type(error).__name__}: {_first_line(error)}"
            self.stats.eager_steps += 1
            return None
        self._account(key, new, _graph_count() - graphs_before, (time.perf_counter() - started) * 1e3)
        return logits[:rows]

    def _may_compile(self, graphs: DecodeGraphs) -> bool:
        if not self.allow_new_graphs:
            return False
        if len(graphs.shapes) >= MAX_GRAPHS_PER_MODEL:
            self.stats.fallback_reason = f"graph limit: {MAX_GRAPHS_PER_MODEL} decode shapes already compiled"
            return False
        return True

    def _inputs(self, runner, key: tuple[int, int, int]) -> tuple:
        store, (rows, columns, _) = runner.store, key
        pad = rows - runner.active_rows
        input_ids, positions = runner.next_input, runner.next_position
        if pad:
            input_ids = torch.cat([input_ids, input_ids.new_full((pad,), runner.pad_token_id)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        column = torch.tensor([store.front], dtype=torch.long, device=input_ids.device)
        return (
            input_ids[:, None], positions[:, None], store.attend[:rows, None, None, :columns], column,
            [k[:rows, :, :columns] for k in store.keys], [v[:rows, :, :columns] for v in store.values],
        )  # fmt: skip

    def _account(self, key: tuple[int, int, int], new: bool, compiled: int, elapsed_ms: float) -> None:
        stats, graphs = self.stats, self.graphs
        stats.compiled_steps += 1
        self.last_step_compiled = new or compiled > 0
        if new:
            graphs.shapes.add(key)
            stats.new_graphs += 1
            stats.compile_ms += elapsed_ms
        elif compiled:
            stats.recompiles += compiled
            stats.compile_ms += elapsed_ms
            graphs.recompiles += compiled
            if graphs.recompiles > MAX_RECOMPILES_PER_MODEL:
                self._disable(f"recompile storm: {graphs.recompiles} recompiles of already compiled decode shapes")

    def _disable(self, reason: str) -> None:
        self.graphs.disabled_reason = reason
        self.stats.fallback_reason = reason
        warnings.warn(f"autobucket: compiled decode disabled for this model, decoding eagerly ({reason})", RuntimeWarning, stacklevel=2)
