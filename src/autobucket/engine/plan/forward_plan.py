"""The forward plan: for every op family, which backend runs it and why, and the decode step's form.

`choose_plan` makes it once per call (`Rollout._run_route`) from the model, its device and dtype, the
config (`kernels`, `op_backends`) and the call's compile decision; `plan_entered` opens it for the call's
forwards on this thread (`intercept/active.py`), where every interceptor reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from autobucket.engine.decode.eligibility import ineligible_reason
from autobucket.engine.decode.graph_capture import capture_obstacle
from autobucket.engine.intercept.active import forward_with
from autobucket.engine.intercept.attention import dispatches
from autobucket.engine.intercept.elementwise import elementwise_on
from autobucket.engine.intercept.kernel_sets import invariant_kernels, runs_triton_set
from autobucket.engine.kernel_choice import engine_kernels_obstacle
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.plan import ops
from autobucket.engine.plan.backends import register_backend, registered_backend
from autobucket.engine.plan.builtin_backends import CpuBackend, TorchBackend, TritonBackend

for _builtin in (TorchBackend(), CpuBackend(), TritonBackend()):
    register_backend(_builtin)

NO_BACKEND = "none"  # an op the call does not run (shared-prefix attention where rows read own copies)
# the ops `RolloutConfig(op_backends=...)` may give to a backend; `kernels=` picks the kernel set's ops
OVERRIDABLE_OPS = (*ops.ELEMENTWISE_OPS, ops.DECODE_ATTENTION)


@dataclasses.dataclass(frozen=True)
class OpChoice:
    backend: str
    reason: str
    function: Callable | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """What a call's forwards run: `kernel_set` ("torch", "cpu", "triton") runs the linears and the
    attention calls, `choices` names every op family's backend, `decode_step` the step's form."""

    kernel_set: str
    choices: tuple[tuple[str, OpChoice], ...]
    decode_step: str
    decode_step_reason: str

    def choice(self, op: str) -> OpChoice:
        return dict(self.choices)[op]

    def backend_of(self, op: str) -> str:
        return self.choice(op).backend

    def function(self, op: str) -> Callable | None:
        return self.choice(op).function

    def elementwise(self) -> dict[str, Callable]:
        """op -> the function replacing the modeling code's op, for the elementwise ops not on torch."""
        return {op: c.function for op, c in self.choices if op in ops.ELEMENTWISE_OPS and c.function is not None}

    @property
    def shares_prefixes(self) -> bool:
        """Whether rows may read one shared copy of K/V (shared-prefix decode attention)."""
        return self.backend_of(ops.SHARED_PREFIX_ATTENTION) != NO_BACKEND

    def summary(self) -> dict[str, Any]:
        """A compact record for `Profile.plan`: op -> backend, "decode_step", and "reasons" (op -> why)."""
        return {
            **{op: c.backend for op, c in self.choices}, "decode_step": self.decode_step,
            "reasons": {**{op: c.reason for op, c in self.choices}, "decode_step": self.decode_step_reason},
        }  # fmt: skip


def check_op_backends(op_backends: Mapping[str, str]) -> None:
    """ValueError for an op the config may not assign or a backend nobody registered."""
    for op, name in op_backends.items():
        if op not in ops.OPS:
            raise ValueError(f"op_backends names {op!r}, which is no op family: choose from {', '.join(ops.OPS)}")
        if op not in OVERRIDABLE_OPS:
            raise ValueError(
                f"op_backends={{{op!r}: {name!r}}}: {op} follows the kernel set (kernels='invariant' or 'torch'); "
                f"op_backends may choose the backend of {', '.join(OVERRIDABLE_OPS)}"
            )
        registered_backend(name)


def choose_plan(model: torch.nn.Module, config: Any, compile_decision: Any = None, route: str | None = None) -> ForwardPlan:
    """The plan of one call on `model` (its device and dtype read off its parameters) under `config`
    (`kernels`, `op_backends`); `compile_decision` and `route` give the decode step's form. ValueError
    where `op_backends` asks for a backend that cannot run its op here (the backend's reason)."""
    op_backends = config.op_backends or {}
    check_op_backends(op_backends)
    kernel_set, why = _kernel_set(config.kernels, model, config)
    step, reason = _decode_step(model, compile_decision, route, kernel_set, getattr(config, "cuda_graphs", "auto"))
    choices = []
    for op in ops.OPS:
        wanted = op_backends.get(op)
        choice = _required(op, wanted, model) if wanted is not None else _default(op, kernel_set, model, why)
        if op == ops.SHARED_PREFIX_ATTENTION and step == "captured":
            choice = OpChoice(NO_BACKEND, "the captured decode step reads each row's own copy of its K/V")
        choices.append((op, choice))
    return ForwardPlan(kernel_set, tuple(choices), step, reason)


def trainer_plan(model: torch.nn.Module) -> ForwardPlan:
    """The plan `autobucket.invariant(model)` opens for a trainer's forward: the engine's kernel set for
    the linears and attention (the rollout's under kernels="invariant"), the modeling code's own
    elementwise ops (the Triton set's RMSNorm on its set), the model's forward."""
    kernel_set, why = _kernel_set("invariant", model, None)
    choices = []
    for op in ops.OPS:
        if op in (*ops.KERNEL_SET_OPS, ops.DECODE_ATTENTION) or (op == ops.RMS_NORM and kernel_set == "triton"):
            choices.append((op, _default(op, kernel_set, model, why)))
        else:
            choices.append((op, OpChoice("torch", "a trainer's forward keeps the modeling code's own op")))
    return ForwardPlan(kernel_set, tuple(choices), "model", "a trainer's forward")


def _required(op: str, name: str, model: torch.nn.Module) -> OpChoice:
    supplied = registered_backend(name).supply(op, model)
    if isinstance(supplied, str):
        raise ValueError(f"op_backends={{{op!r}: {name!r}}} cannot run on {type(model).__name__}: {supplied}; choose another backend or drop the entry")
    return OpChoice(name, "asked for in RolloutConfig(op_backends=...)", supplied)


def _first_supplying(op: str, names: tuple[str, ...], model: torch.nn.Module, why: str) -> OpChoice:
    """The first backend of `names` that supplies `op`, with the reasons of those before it that could not."""
    refusals = []
    for name in names:
        supplied = registered_backend(name).supply(op, model)
        if not isinstance(supplied, str):
            return OpChoice(name, "; ".join([*refusals, f"{name} runs it"]) if refusals else why, supplied)
        refusals.append(f"not {name}: {supplied}")
    raise AssertionError(f"no backend of {names} supplies {op}: {'; '.join(refusals)}")  # "torch" always does


def _kernel_set(kernels: str, model: torch.nn.Module, config: Any) -> tuple[str, str]:
    """The backend of the linears and attention calls, and why: "invariant" requires the engine's set
    (refused elsewhere before the plan is made), "torch" is the model's own, and "auto" takes the engine's
    set where `engine_kernels_obstacle` finds nothing in its way (the model's own set elsewhere, with the
    engine's other kernels per op)."""
    engine_set = "triton" if runs_triton_set(next(model.parameters()).device) else "cpu"
    if kernels == "invariant":
        return engine_set, "kernels='invariant': the batch-invariant kernel set"
    if kernels == "auto":
        obstacle = engine_kernels_obstacle(model, config)
        if obstacle is not None:
            return "torch", f"kernels='auto': the model's own linears and attention, since {obstacle}"
        return engine_set, f"kernels='auto': the engine's {engine_set} kernel set runs this model"
    return "torch", "kernels='torch': the model's own ops"


def _default(op: str, kernel_set: str, model: torch.nn.Module, why: str) -> OpChoice:
    """`op`'s backend where the config names none: the kernel set's, or for the ops outside it the
    engine's kernel where the kernel set is the engine's (or the policy is "auto") and it can run."""
    engine_ops = kernel_set != "torch" or why.startswith("kernels='auto'")
    if op in ops.KERNEL_SET_OPS:
        supplied = None if kernel_set == "torch" else registered_backend(kernel_set).supply(op, model)
        return OpChoice(kernel_set, why, supplied)
    if op == ops.DECODE_ATTENTION:
        if kernel_set != "torch":
            return OpChoice(kernel_set, "the kernel set's invariant attention (as prefill)")
        if engine_ops:
            return _first_supplying(op, ("cpu", "torch"), model, "the decode kernel reads only each row's own keys")
        return OpChoice("torch", "kernels='torch': transformers' SDPA")
    if op == ops.SHARED_PREFIX_ATTENTION:
        return _shared_prefix(kernel_set, model)
    if op in ops.ELEMENTWISE_OPS:
        if not engine_ops:
            return OpChoice("torch", "kernels='torch': the modeling code's own op")
        if op == ops.RMS_NORM and kernel_set == "triton":
            return _first_supplying(op, ("triton", "torch"), model, "the Triton set's row kernel (batch-invariant on a GPU)")
        return _first_supplying(op, ("cpu", "torch"), model, "the fused kernel, bitwise the modeling code's values")
    if op == ops.LOGPROBS:
        return _first_supplying(op, ("cpu", "torch"), model, "bitwise torch's log_softmax of the bf16 logits, without the copy")
    return OpChoice("torch", "the engine's sampler on torch ops")


def _shared_prefix(kernel_set: str, model: torch.nn.Module) -> OpChoice:
    if not dispatches(model):
        return OpChoice(NO_BACKEND, "the model's attention does not go through transformers' 'sdpa': rows read their own copies")
    if kernel_set == "triton":
        return OpChoice("triton", "the Triton kernel walks [shared keys | own keys] as one sequence (bitwise a copy's)")
    if kernel_set == "cpu":
        return OpChoice("cpu", "the invariant kernel walks [shared keys | own keys] as one sequence (bitwise a copy's)")
    if next(model.parameters()).device.type != "cpu":
        return OpChoice(NO_BACKEND, "the torch form of shared-prefix attention runs on CPUs: rows read their own copies")
    return OpChoice("torch", "two SDPA parts merged by their softmax statistics (equal to a copy's up to rounding)")


def _decode_step(
    model: torch.nn.Module, compile_decision: Any, route: str | None, kernel_set: str, cuda_graphs: bool | str
) -> tuple[str, str]:
    """The decode step's form and why. The captured form is a call's continuous-batching decode (a
    `route`) on the engine's step, on CUDA, where `RolloutConfig.cuda_graphs` allows it; True requires it
    (ValueError naming why not, before any work)."""
    if route == "ordinary":
        step, reason = "model", "route='ordinary' runs transformers' generate"
    elif compile_decision is not None and (compile_decision.use_compiled or compile_decision.compile_new):
        step, reason = "compiled", compile_decision.reason
    elif (refusal := ineligible_reason(model)) is not None:
        step, reason = "model", refusal
    elif route is not None and (obstacle := capture_obstacle(model, kernel_set, cuda_graphs)) is None:
        return "captured", "the engine's Llama-family step replayed from a CUDA graph per row and column bucket"
    else:
        obstacle = obstacle if route is not None else "not a call's continuous-batching decode"
        step, reason = "engine", f"the engine's Llama-family step, bitwise the model's forward (not captured: {obstacle})"
    if cuda_graphs is True and route is not None:
        raise ValueError(
            f"RolloutConfig(cuda_graphs=True) cannot capture this call's decode step: it runs the {step!r} form "
            f"({reason}); use cuda_graphs='auto' to capture where it can"
        )
    return step, reason


@contextmanager
def plan_entered(plan: ForwardPlan, model: torch.nn.Module, packs: PackedLinears | None, conv1d: bool = False) -> Iterator[None]:
    """This thread's forwards in the block run `plan`: its elementwise functions, its kernel set (`packs`
    holds the C++ set's packed weights) and the plan on the `active()` record."""
    with ExitStack() as stack:
        stack.enter_context(forward_with(plan=plan))
        stack.enter_context(elementwise_on(model, plan.elementwise()))
        if plan.kernel_set == "cpu":
            assert packs is not None, "the CPU kernel set runs on packed weights"
            stack.enter_context(invariant_kernels(packs, conv1d=conv1d))
        elif plan.kernel_set == "triton":
            from autobucket.engine.intercept.triton_set import triton_kernels  # imports triton

            stack.enter_context(triton_kernels(model, conv1d))
        yield
