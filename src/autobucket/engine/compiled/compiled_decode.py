"""The continuous-batching decode step compiled with `torch.compile` over static shapes.

What is compiled is the eager step itself: for a Llama-family model the engine's one decode step
(`engine/decode/step.py`) on its graph ops (the model's modules, the grouped attention below), for any
other model its forward; never another implementation.

Why it can be static: the `StaticKVCache` is preallocated and right-aligned, so one decode step is
"write column `front` of every row, attend over columns `[0, front]`". The compiled step takes the
cache buffers sliced to a *column bucket* (a multiple of `COLUMN_STEP` covering `front + 1`), the
additive mask over the same columns, the position ids and the write column as a tensor; rows are
padded up to a *row bucket* (powers of two, plus the cache's row count). A call therefore reuses a
handful of graphs, and graphs survive across calls: they are cached per model, keyed by
(rows, columns, cache capacity) — the capacity is rounded up to a multiple of `COLUMN_STEP` so calls
of similar lengths share strides and graphs (an explicit `cache_capacity` is a memory limit: kept
exactly, `store_columns`). The step receives a `StepInputs`, never the runner.

Padded rows feed the pad token at position 0 with every column masked; their logits are dropped and
the garbage they write lands in rows no active row reads (admission rewrites a row's columns and mask).

Weights are read live: the model's parameters are graph inputs, not constants, so an in-place
optimizer step changes the next call's tokens without a recompile. (Inductor's `freezing` would bake
them in as constants and return the old model's tokens; measured, see docs/benchmarks.md.)

Attention: under dynamo, transformers expands grouped K/V heads with `repeat_kv` (a full copy of the
cache every step, slower than the eager step; docs/benchmarks.md); here one decode token's query heads are grouped
onto their K/V head instead (`[rows, kv_heads, group, head_dim]`), so SDPA reads the cache in place.
The step passes that function as a forward keyword which transformers hands down to the attention
call (`engine/intercept/attention.py`); the model's config is never written, so other threads are unaffected.

Errors propagate; only compiling falls back. A compiled graph that raises at run time (the model's
error, `torch.OutOfMemoryError`) raises the same exception object out of `step`. Dynamo reports an
exception the model's own code raises *while traced* as `Unsupported` caused by an `ObservedException`
(torch 2.13, measured): that step runs eagerly, where the model raises its real exception; only if the
eager step succeeds was it a tracing problem, and the next step disables compiling. Any other dynamo
or inductor failure (a graph break under `fullgraph=True`, `BackendCompilerFailed`, our attention's
NotImplementedError at trace time, an AssertionError from dynamo's own checks — "Guard failed on the
same frame it was created" when another thread wrote state the trace read), a graph limit or a
recompile storm disables the compiled path for that model with one warning and the reason in the
profile; eager decoding continues.

Other threads' forwards during a compile: torch holds `torch.compiler.is_compiling()` True for every
thread through a compile session, so the engine's routers ask `is_dynamo_compiling()` (True only in
the trace), and the kernels hub's and transformers' per-forward variables are replaced before the first
compile (`trace_local_variables`): a trainer thread's eager forward keeps its own state throughout."""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from autobucket.engine.batching.static_cache import StaticKVCache
from autobucket.engine.compiled.dynamo_compat import (
    is_observed_not_implemented,
    lifted_graph_limit,
    observed_description,
    observed_model_error,
    raised_by_compiler,
)
from autobucket.engine.compiled.trace_local_variables import make_trace_local
from autobucket.engine.decode.ops import decode_ops
from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.decode.step import llama_decode_step
from autobucket.engine.intercept.attention import ATTENTION_KEYWORD, install_dispatcher
from autobucket.engine.intercept.functions import compiled_dropout_off, dropout_suppressed
from autobucket.engine.model_access.hf_compat import CacheLayerFace
from autobucket.engine.model_access.weight_versions import forward_state

COLUMN_STEP = 128  # column bucket granularity: attention over <= 127 masked columns, few graphs
MAX_GRAPHS_PER_MODEL = 24  # beyond this a new shape decodes eagerly (compile is tens of seconds each)
MAX_RECOMPILES_PER_MODEL = 4  # guard failures on an already compiled shape before giving up


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


def store_columns(columns: int, round_capacity: bool) -> int:
    """The columns a compiled call's cache gets: rounded up so calls of similar lengths share graphs,
    or exactly `columns` when they are an explicit `cache_capacity` (a memory limit)."""
    return rounded_capacity(columns) if round_capacity else columns


def predicted_graph_keys(
    rows: int, longest: int, max_new_tokens: int, capacity: int, hooks: int = 0
) -> set[tuple[int, int, int, int]]:
    """The (rows, columns, capacity, hooks) graphs a call with full rows will visit (its tail may add smaller
    row buckets); `capacity` is the store's exact column count (`store_columns`), `hooks` the model's
    `hooks_epoch`, as in the real keys."""
    first, last = column_bucket(longest + 1, capacity), column_bucket(longest + max_new_tokens, capacity)
    columns = {*range(first, last, COLUMN_STEP), last}  # last: the capacity itself when it caps a bucket
    return {(row_bucket(rows, rows), c, capacity, hooks) for c in columns}


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
    install_dispatcher()  # the engine's attention reaches the graph as a forward keyword, never via the config


# ------------------------------------------------------------------ the cache face inside the graph
class StepCache(Cache):
    """transformers `Cache` that writes one decode column by index into bucket views (traceable, fixed shape)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], column: torch.Tensor) -> None:
        super().__init__(layers=[CacheLayerFace(self, layer, compileable=True) for layer in range(len(keys))])
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


def decode_step(model, parts, cache_keyword, hooks, input_ids, position_ids, mask, column, keys, values):
    """The function compiled: parts, the model's `LlamaParts` (the engine's step) or None (its forward);
    hooks, the model's `hooks_epoch`; input_ids, position_ids [rows, 1]; mask [rows, 1, 1, columns];
    column [1]; keys[l], values[l] [rows, kv_heads, columns, head_dim] -> logits [rows, vocab] fp32."""
    # Read, so dynamo guards on it (an unused int argument gets no guard): each set of hooks its own graph.
    torch._check(hooks >= 0)
    cache = StepCache(keys, values, column)
    if parts is not None:
        write = lambda layer, key, value: cache.update(key, value, layer)  # noqa: E731
        logits = llama_decode_step(parts, decode_ops(parts, mask, position_ids, grouped_decode_attention), input_ids, position_ids, write)
        return logits[:, -1, :].float()
    output = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_keyword: cache, ATTENTION_KEYWORD: grouped_decode_attention},
    )
    return output.logits[:, -1, :].float()


# ------------------------------------------------------------------ graphs per model, across calls
@dataclass
class DecodeGraphs:
    """One model's compiled shapes; kept while the model lives, so later calls reuse its graphs."""

    shapes: set[tuple[int, int, int, int]] = field(default_factory=set)  # (rows, columns, capacity, hooks)
    hook_sets: dict[tuple, int] = field(default_factory=dict)  # `hooks_epoch` of each hook set past none (0)
    recompiles: int = 0  # guard failures on an already compiled shape, over the model's lifetime
    disabled_reason: str = ""  # non-empty: this model decodes eagerly from now on


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED_STEP = None  # one torch.compile wrapper; dynamo keys its graphs by model and shapes


def decode_graphs(model: torch.nn.Module) -> DecodeGraphs:
    if model not in _GRAPHS:
        _GRAPHS[model] = DecodeGraphs()
    return _GRAPHS[model]


def hooks_epoch(model: torch.nn.Module) -> int:
    """Which forward hooks the model has now, as a small int per model (0: none). Dynamo does not guard
    on module hooks (`skip_nnmodule_hook_guards`, on by default): a graph traced before a trainer added a
    hook would skip it, one traced with a hook would run it after its removal. So the epoch is part of
    every graph key and an argument the graph is specialised on. Read once per call (a walk over the
    model's modules): hooks changed by another thread during a call reach its eager steps only; a hook set
    registered anew for every call compiles anew until the graph limit, then decodes eagerly."""
    signature = forward_state(model)  # hooks (and forwards replaced on an instance) by registration
    if signature == ((), (), ()):
        return 0
    epochs = decode_graphs(model).hook_sets
    return epochs.setdefault(signature, len(epochs) + 1)


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


@dataclass(frozen=True)
class StepInputs:
    """What one decode step reads: the active rows' next tokens and positions, and the cache they extend."""

    tokens: torch.Tensor  # [rows] long, the token each active row feeds at this step
    positions: torch.Tensor  # [rows] long, its true position
    store: StaticKVCache  # the engine's static cache; this step writes its column `front`
    pad_token_id: int  # fed by the padding rows of a row bucket
    parts: LlamaParts | None = None  # the engine's step runs on these; None: the model's forward


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
        self.hooks = hooks_epoch(model)  # this call's forward hooks, which its graphs must have traced
        self.stats = CompileStats(fallback_reason=self.graphs.disabled_reason)
        self.last_step_compiled = False  # the last step's time was compile time (kept out of step timings)
        self.traced_error = ""  # the last step's trace hit the model's own raise; its eager step decides
        make_trace_local()  # before any compile: other threads' forwards keep their own library variables

    def capacity(self, columns: int) -> int:
        """Cache columns to allocate (`store_columns`)."""
        return store_columns(columns, self.round_capacity)

    def step(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits [rows, vocab] fp32 of one decode step, or None: decode this step eagerly.

        Whatever the compiled graph raises at run time (a model error, `torch.OutOfMemoryError`)
        propagates unchanged; only a failure to trace or compile is caught (`_compile_failed`)."""
        store, graphs = inputs.store, self.graphs
        rows, self.last_step_compiled = int(inputs.tokens.shape[0]), False
        if self.traced_error:  # the model raised while traced, yet its eager step ran: a tracing problem
            reason, self.traced_error = self.traced_error, ""
            self._disable(f"the model raised only while traced: {reason}")
        key = (
            row_bucket(rows, store.rows), column_bucket(store.front + 1, store.columns), store.columns, self.hooks
        )  # fmt: skip
        new = key not in graphs.shapes
        if graphs.disabled_reason or (new and not self._may_compile(graphs)):
            self.stats.eager_steps += 1
            return None
        started, graphs_before = time.perf_counter(), _graph_count()
        try:
            with lifted_graph_limit(), compiled_dropout_off(dropout_suppressed()):
                logits = _compiled_step()(
                    self.model, inputs.parts, self.cache_keyword, self.hooks, *self._inputs(inputs, key)
                )
        except torch._dynamo.exc.TorchDynamoException as error:
            self._compile_failed(error)
            return None
        except AssertionError as error:  # dynamo's own consistency checks (`raised_by_compiler`)
            if not raised_by_compiler(error):
                raise
            self._compile_failed(error)
            return None
        self._account(key, new, _graph_count() - graphs_before, (time.perf_counter() - started) * 1e3)
        return logits[:rows]

    def _compile_failed(self, error: BaseException) -> None:
        """Dynamo or inductor could not produce the graph: this step runs eagerly."""
        self.stats.eager_steps += 1
        observed = observed_model_error(error)
        reason = f"{type(error).__name__}: {_first_line(error)}"
        if observed is not None:
            reason += f" ({observed_description(observed)})"
        if observed is None or is_observed_not_implemented(observed):
            self._disable(reason)  # a graph break, a backend failure, an unsupported attention
            return
        # The model's own code raised under tracing. Dynamo holds only a stand-in, so the eager step
        # (next) raises the model's real exception object; if it succeeds instead, the next step disables.
        self.traced_error = reason

    def _may_compile(self, graphs: DecodeGraphs) -> bool:
        if not self.allow_new_graphs:
            return False
        if len(graphs.shapes) >= MAX_GRAPHS_PER_MODEL:
            self.stats.fallback_reason = f"graph limit: {MAX_GRAPHS_PER_MODEL} decode shapes already compiled"
            return False
        return True

    def _inputs(self, inputs: StepInputs, key: tuple[int, int, int, int]) -> tuple:
        store, (rows, columns, _, _) = inputs.store, key
        input_ids, positions = inputs.tokens, inputs.positions
        pad = rows - int(input_ids.shape[0])
        if pad:
            input_ids = torch.cat([input_ids, input_ids.new_full((pad,), inputs.pad_token_id)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        column = torch.tensor([store.front], dtype=torch.long, device=input_ids.device)
        return (
            input_ids[:, None], positions[:, None], store.attend[:rows, None, None, :columns], column,
            [k[:rows, :, :columns] for k in store.keys], [v[:rows, :, :columns] for v in store.values],
        )  # fmt: skip

    def _account(self, key: tuple[int, int, int, int], new: bool, compiled: int, elapsed_ms: float) -> None:
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
        warnings.warn(
            f"autobucket: compiled decode disabled for this model, decoding eagerly ({reason})",
            RuntimeWarning,
            stacklevel=2,
        )
