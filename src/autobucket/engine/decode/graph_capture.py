"""Capturing one decode step and replaying it: a CUDA graph, or its test-only stand-in on the CPU.

`CudaGraphStep` warms the step up on a side stream (first calls compile Triton kernels and let the
allocator settle), then records it with `torch.cuda.graph` into a memory pool shared by a runner's
graphs. Capture errors are thread-local, so a trainer thread's forward beside it is untouched.

`TracedStep` is the stand-in (`graphs_on_cpu`, a test switch): the step traced once with
`make_fx` into an aten graph whose tensors are constants held by reference (the same storage, as a
CUDA graph holds addresses), replayed by running that graph and copying its result into one output
tensor. It has a CUDA graph's semantics where they can bite: Python values are frozen at the trace,
inputs reach it only through the tensors it was traced on, the output is overwritten in place at every
replay, and weights are read from their storage (an in-place update is seen, a replaced tensor is not).
Chosen over `torch.export` because the step reads the model's modules, the store's views and the
kernels' custom ops from closures, as the CUDA capture does; `make_fx` records exactly what ran."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autobucket.engine.intercept.active import active, forward_with

StepFunction = Callable[[], torch.Tensor]  # one decode step over persistent buffers -> logits [rows, vocab]
WARMUP_CALLS = 2  # before a capture: Triton's first call compiles, cuBLAS picks its workspace


class CaptureError(RuntimeError):
    """Recording a step failed after its warm-up ran it eagerly (so not the model's error): something in
    the step cannot be captured, such as a read of a device value on the host."""


@contextmanager
def graphs_on_cpu() -> Iterator[None]:
    """Test switch: in the block a CPU model's decode may take the captured form, on `TracedStep`."""
    with forward_with(graphs_on_cpu=True):
        yield


def captures_on(device: torch.device) -> bool:
    """Whether a decode step on `device` can be captured here (CUDA, or the stand-in switched on)."""
    return device.type == "cuda" or (device.type == "cpu" and active().graphs_on_cpu)


class CudaGraphStep:
    """`run` recorded once in a CUDA graph; `replay()` -> the graph's own output tensor (overwritten by
    the next replay)."""

    def __init__(self, run: StepFunction, pool: tuple) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the model's own errors and OOM raise here, unchanged
            for _ in range(WARMUP_CALLS):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _capture_errors(), torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = run()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class TracedStep:
    """`run` traced once (it runs for real while traced, as a warm-up does); `replay()` -> one output
    tensor, overwritten in place by every replay."""

    def __init__(self, run: StepFunction, pool: tuple | None = None) -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        run()  # the warm-up: the model's own errors raise here, unchanged
        with _capture_errors(), _NoHostReads():
            self.graph = _held_by_storage(make_fx(run, tracing_mode="real")())
        self.output: torch.Tensor | None = None  # the first replay's result, written over by the next

    def replay(self) -> torch.Tensor:
        result = self.graph()
        if self.output is None:
            self.output = result
        else:
            self.output.copy_(result)
        return self.output


class _NoHostReads(TorchDispatchMode):
    """Fails an op that hands a device value to the host (`.item()`, `bool(tensor)`, `torch.equal`, a
    data-dependent shape), as a CUDA capture fails it; make_fx alone lets a read of an input through."""

    READS = frozenset(
        {
            torch.ops.aten.item.default,
            torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.equal.default,
            torch.ops.aten.nonzero.default,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise RuntimeError(f"{func} reads a device value on the host, which a CUDA graph cannot hold")
        return func(*args, **(kwargs or {}))


@contextmanager
def _capture_errors() -> Iterator[None]:
    """A failure while recording -> CaptureError (out of memory propagates unchanged)."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise CaptureError(f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}") from error


def _held_by_storage(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph` with each tensor it holds (make_fx keeps the tensor objects, parameters included) replaced
    by a new tensor over the same storage: as a CUDA graph holds addresses, an in-place write is seen and a
    tensor given new storage (`.data =`, `model.to`) is not."""
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        held = getattr(graph, node.target)
        if isinstance(held, torch.Tensor):
            delattr(graph, node.target)
            setattr(graph, node.target, held.detach())
    return graph


def new_pool(device: torch.device) -> tuple | None:
    """The memory pool a runner's graphs share (None for the stand-in)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def capture(run: StepFunction, device: torch.device, pool: tuple | None) -> CudaGraphStep | TracedStep:
    """`run` captured for `device`: a CUDA graph, or the stand-in on the CPU."""
    if device.type == "cuda":
        return CudaGraphStep(run, pool)
    return TracedStep(run)


def capture_obstacle(model: torch.nn.Module, kernel_set: str, setting: bool | str) -> str | None:
    """Why a call's decode steps on `model` under `kernel_set` are not captured (None: they are), given
    `RolloutConfig.cuda_graphs` (`setting`); the engine's step must already stand in for the forward."""
    if setting is False:
        return "cuda_graphs=False"
    device = next(model.parameters()).device
    if not captures_on(device):
        return f"CUDA graphs need a CUDA device (the model is on {device.type})"
    if kernel_set == "cpu":
        return "the C++ kernel set reads packed copies of the weights, which a graph would keep after an update"
    return None
