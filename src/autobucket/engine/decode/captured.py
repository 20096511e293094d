"""The captured form of the decode step: the engine's Llama-family step (`step.py`) recorded once per
(row bucket, column bucket) of a runner's static cache and replayed at every later step of that bucket.

One step replays the kernels of one eager step with none of its Python: on a GPU the step's launch
overhead (a few hundred kernels of a small model) is most of its time. What the graph reads that
changes per step is written into persistent buffers first (`graph_buffers.StepBuffers`); the K/V are
the store's own tensors, the weights the model's (in-place updates are seen; nothing is copied).

Graphs belong to the runner's store (they hold its addresses) and are kept under a fingerprint of
what they recorded: the kernel set and its test switch, the weights' storage, dtype and device, the
forward hooks and replaced forwards, the adapters' state. It is compared before every step; a change
drops every graph, and the next steps capture anew. Buckets are those of the compiled step: rows
padded to a power of two, columns to a multiple of `CAPTURE_COLUMN_STEP`; past `MAX_GRAPHS_PER_STORE`
graphs a new bucket decodes eagerly. A step that cannot be recorded (`CaptureError`: its warm-up ran, so
the model's own errors have already raised unchanged) turns capturing off for the runner with one
warning; it decodes eagerly from then on.

The logits a step returns are a view of the graph's output tensor: the next replay writes over them
(the engine samples from them before that)."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autobucket.engine.batching.static_cache import StaticKVCache
from autobucket.engine.compiled.compiled_decode import COLUMN_STEP, row_bucket
from autobucket.engine.decode.forms import CAPTURED
from autobucket.engine.decode.graph_buffers import StepBuffers
from autobucket.engine.decode.graph_capture import CaptureError, capture, new_pool
from autobucket.engine.decode.ops import decode_ops
from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.decode.step import llama_decode_step
from autobucket.engine.intercept.active import active
from autobucket.engine.intercept.attention import engine_attention, kernel_attention_active
from autobucket.engine.model_access.weight_versions import adapter_state, forward_state

CAPTURE_COLUMN_STEP = COLUMN_STEP  # column bucket granularity (a test lowers it to cross buckets at toy sizes)
MAX_GRAPHS_PER_STORE = 64  # beyond this a new bucket decodes eagerly

_CAPTURES = [0]  # graphs captured in this process (`captures_made`)


def captures_made() -> int:
    """How many decode graphs this process has captured (tests count captures with it)."""
    return _CAPTURES[0]


def column_bucket(columns: int, capacity: int) -> int:
    """Smallest multiple of CAPTURE_COLUMN_STEP >= columns, capped at the store's capacity."""
    return min(-(-columns // CAPTURE_COLUMN_STEP) * CAPTURE_COLUMN_STEP, capacity)


def graph_fingerprint(model: torch.nn.Module) -> tuple:
    """What a captured step recorded besides its buffers: the plan's kernel set (and the Triton set's
    CPU switch), every parameter's and buffer's storage address and dtype, the device, the forward hooks
    and replaced forwards, the adapters' state."""
    plan, record = active().plan, active()
    tensors = tuple((t.data_ptr(), t.dtype, t.device) for t in (*model.parameters(), *model.buffers()))
    kernel_set = plan.kernel_set if plan is not None else None
    return kernel_set, record.triton_on_cpu, tensors, forward_state(model), adapter_state(model)


@dataclass
class CaptureStats:
    """What one runner's captured form did."""

    graphs: int = 0  # captures made
    capture_ms: float = 0.0  # wall time of the steps that captured (warm-up and recording)
    replayed_steps: int = 0
    eager_steps: int = 0  # steps past the graph limit, or after a capture failed
    dropped_graphs: int = 0  # graphs dropped because the fingerprint changed
    fallback_reason: str = ""  # why this runner stopped capturing (empty: it did not)


@dataclass
class _Graph:
    buffers: StepBuffers
    step: object  # graph_capture.CudaGraphStep | TracedStep


class CapturedDecode:
    """A `ModelRunner`'s captured decode steps. `attention`: the attention the eager step runs under
    (the runner's decode attention override), in force while a step is captured."""

    def __init__(self, model: torch.nn.Module, parts: LlamaParts, pad_token_id: int, attention: Callable | None) -> None:
        self.model, self.parts, self.pad_token_id, self.attention = model, parts, pad_token_id, attention
        self.device = parts.lm_head.weight.device
        self.pool = new_pool(self.device)
        self.boolean_mask = kernel_attention_active()  # the engine's kernel reads the mask, not SDPA
        self.store: StaticKVCache | None = None
        self.fingerprint: tuple | None = None
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (rows, columns) -> its graph
        self.stats = CaptureStats()
        self.last_step_captured = False  # the last step's time was capture time

    def step(self, store: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Logits [live rows, vocab] fp32 of one step of rows feeding `tokens` at `positions` [live], or
        None: past the graph limit, decode this step eagerly."""
        self._drop_stale(store)
        live = int(tokens.shape[0])
        key = (row_bucket(live, store.rows), column_bucket(store.front + 1, store.columns))
        graph, self.last_step_captured = self.graphs.get(key), False
        if graph is None and (self.stats.fallback_reason or len(self.graphs) >= MAX_GRAPHS_PER_STORE):
            self.stats.eager_steps += 1
            return None
        if graph is None:
            graph = self._capture(store, key, tokens, positions)
            if graph is None:
                return None
        else:
            graph.buffers.fill(tokens, positions)
        self.stats.replayed_steps += 1
        return graph.step.replay()[:live]

    def _drop_stale(self, store: StaticKVCache) -> None:
        fingerprint = graph_fingerprint(self.model)
        if store is self.store and fingerprint == self.fingerprint:
            return
        self.stats.dropped_graphs += len(self.graphs)
        self.graphs.clear()
        self.store, self.fingerprint = store, fingerprint

    def _capture(
        self, store: StaticKVCache, key: tuple[int, int], tokens: torch.Tensor, positions: torch.Tensor
    ) -> _Graph | None:
        """The bucket's graph, captured now; None where it cannot be (capturing is then off)."""
        started = time.perf_counter()
        buffers = StepBuffers(store, *key, self.pad_token_id, self.boolean_mask)
        buffers.fill(tokens, positions)
        try:
            with engine_attention(self.attention) if self.attention is not None else contextlib.nullcontext():
                graph = _Graph(buffers, capture(self._run(buffers), self.device, self.pool))
        except CaptureError as error:
            self._stop_capturing(str(error))
            return None
        self.graphs[key] = graph
        self.stats.graphs += 1
        self.stats.capture_ms += (time.perf_counter() - started) * 1e3
        self.last_step_captured = True
        _CAPTURES[0] += 1
        return graph

    def _stop_capturing(self, reason: str) -> None:
        self.stats.fallback_reason = reason
        self.stats.eager_steps += 1
        self.graphs.clear()
        warnings.warn(f"autobucket: CUDA-graph decode off for this call, decoding eagerly ({reason})", RuntimeWarning, stacklevel=3)

    def _run(self, buffers: StepBuffers) -> Callable[[], torch.Tensor]:
        """The step over `buffers`: what is captured. -> logits [bucket rows, vocab] fp32."""
        parts = self.parts

        def run() -> torch.Tensor:
            mask = buffers.mask_view()
            ops = decode_ops(parts, mask, buffers.positions)
            logits = llama_decode_step(parts, ops, buffers.tokens, buffers.positions, buffers.write)
            return logits[:, -1, :].float()

        return run


def captured_decode_for(
    model: torch.nn.Module, parts: LlamaParts | None, pad_token_id: int, attention: Callable | None
) -> CapturedDecode | None:
    """A runner's captured steps where the plan in force chose the captured form, else None."""
    plan = active().plan
    if plan is None or plan.decode_step != CAPTURED or parts is None:
        return None
    return CapturedDecode(model, parts, pad_token_id, attention)
