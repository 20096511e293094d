"""What tells the engine the trainer's weights changed since it last looked, so nothing derived from
old weights (packed linears, prefix-cache K/V) is ever used after an update.

- A parameter's `(data_ptr, _version)`: `_version` increases on every in-place change autograd sees
  (an unfused optimizer step, `copy_` under `no_grad`, `load_state_dict`); `param.data = t` changes
  `data_ptr()`.
- A process-wide count of optimizer steps: fused optimizers (`torch.optim.AdamW(fused=True)`, TRL's
  default `adamw_torch_fused`) write the parameters in kernels that do not bump `_version` (it stays 1
  after a fused AdamW step, tested). torch calls global optimizer step hooks after every
  `Optimizer.step` of every optimizer, so one hook counting them (registered at first use, never
  removed, touching nothing but the counter) sees those updates too. Any optimizer's step counts — a
  reward model's included: a false alarm costs a repack, a miss would cost correctness.
- Writes through `.data` (`p.data.copy_(...)`) are seen by neither: `Rollout.refresh_weights()`.
- Adapter state (`adapter_state`): which of a peft model's adapters run, whether they are disabled, merged
  or rescaled changes the forward without any parameter changing (`set_adapter`, `disable_adapter()`,
  `set_scale`), and peft's merge writes the adapter into the base weight through `.data` (`merge_adapter`
  is seen only here).
- Forward state (`forward_state`): forward hooks (a trainer's steering or logging hook that changes a
  layer's output) and forwards replaced on an instance (accelerate's mixed-precision wrapper) change the
  K/V of every later layer without any parameter changing.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Hashable, Iterator

import torch
from torch.nn.modules import module as module_globals

_LOCK = threading.Lock()
_STEPS = 0
_HOOK = None


def _count_step(optimizer, args, kwargs) -> None:
    global _STEPS
    with _LOCK:
        _STEPS += 1


def optimizer_steps() -> int:
    """Optimizer steps taken in this process since the engine started counting (hook at first use)."""
    global _HOOK
    if _HOOK is None:
        with _LOCK:
            if _HOOK is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                _HOOK = register_optimizer_step_post_hook(_count_step)
    return _STEPS


def in_place_version(tensor: torch.Tensor) -> int | None:
    """A tensor's `_version`; None for inference tensors, which keep no version counter (they cannot be
    changed outside inference mode)."""
    return None if tensor.is_inference() else tensor._version


def tensor_version(tensor: torch.Tensor) -> tuple[int, int | None, int]:
    """(data_ptr, _version, optimizer steps) of one weight."""
    return tensor.data_ptr(), in_place_version(tensor), optimizer_steps()


def weights_version(model: torch.nn.Module, *extra: Hashable) -> tuple:
    """What the K/V of a token sequence depends on besides its tokens: every parameter's and buffer's
    (rotary `inv_freq`, say) storage, in-place version, dtype and shape, the optimizer steps taken, the
    adapters' state, the forward's hooks, plus `extra` (attention backend, kernels)."""
    steps = optimizer_steps()
    tensors = tuple(
        (t.data_ptr(), in_place_version(t), t.dtype, tuple(t.shape))
        for t in (*model.parameters(), *model.buffers())
    )
    return (*extra, steps, tensors, adapter_state(model), forward_state(model))


def forward_state(model: torch.nn.Module) -> tuple:
    """Per module with forward hooks or an instance-level forward: its position, its hooks' handle ids
    (unique per registration: a hook removed and added again is a new state, never an old one) and the
    replaced forward (by weak reference: keys outlive calls, and accelerate's wrapper is a method bound to
    the model); then the global forward hooks. () parts for a plain model."""
    states = (_module_forward_state(index, module) for index, module in enumerate(model.modules()))
    modules = tuple(state for state in states if state is not None)
    return modules, tuple(module_globals._global_forward_pre_hooks), tuple(module_globals._global_forward_hooks)


def _module_forward_state(index: int, module: torch.nn.Module) -> tuple | None:
    """(index, value hooks before, after, replaced forward), or None for a module whose forward is its
    class's with no hooks but value-neutral ones."""
    if not (module._forward_pre_hooks or module._forward_hooks or "forward" in vars(module)):
        return None  # the common case, decided without building anything
    state = (_value_hooks(module._forward_pre_hooks), _value_hooks(module._forward_hooks), _weak(vars(module).get("forward")))
    return None if state == ((), (), None) else (index, *state)


# Hooks that change no value: transformers' `enable_input_require_grads` hook only sets `requires_grad` on
# the embeddings' output, and trainers register a new one at every call of it (TRL's GRPO with gradient
# checkpointing adds one per generation turn: keyed, it emptied the prefix cache between a tool episode's
# turns, and would compile a new decode graph per call).
# `autobucket.invariant`'s position hook supplies position ids only to forwards that pass none, and every
# engine forward passes them (`intercept/trainer_positions.py`).
_VALUE_NEUTRAL_HOOKS = frozenset(
    {
        (
            "transformers.modeling_utils",
            "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",
        ),
        ("autobucket.engine.intercept.trainer_positions", "count_positions_over_real_tokens"),
    }
)


def _value_hooks(hooks: dict) -> tuple:
    """The handle ids of the hooks that may change values."""
    return tuple(
        handle for handle, hook in hooks.items()
        if (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)) not in _VALUE_NEUTRAL_HOOKS
    )


def _weak(value: object) -> Hashable:
    """A key for `value` that does not keep it alive: equal while it lives, never equal to a later object."""
    if value is None:
        return None
    try:
        return weakref.ref(value)
    except TypeError:  # a callable without weak reference support: its id, as long as it is the attribute
        return ("id", id(value))


def adapter_state(model: torch.nn.Module) -> tuple:
    """Per peft tuner layer of `model` (peft's `BaseTunerLayer`): the module (its id: a replaced layer is
    another state), the adapters that run, whether they are disabled, those merged into the base weight,
    and its scaling (LoRA's `scaling` dict). () for a model without adapters."""
    return tuple(
        (
            id(module), tuple(module.active_adapters), bool(module.disable_adapters),
            tuple(module.merged_adapters),
            repr(getattr(module, "scaling", None)),  # LoRA's {adapter: float}; a repr whatever a tuner holds
        )
        for module in _tuner_layers(model)
    )


def merged_adapters(model: torch.nn.Module) -> tuple:
    """The part of `adapter_state` that changes base weights' values without their versions: which
    adapters each layer has merged (peft merges through `.data`)."""
    return tuple((id(module), tuple(module.merged_adapters)) for module in _tuner_layers(model))


def _tuner_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    return (module for module in model.modules() if _is_tuner_class(type(module)))


@functools.cache
def _is_tuner_class(cls: type) -> bool:
    """peft's `BaseTunerLayer` declares `active_adapters`, `disable_adapters` and `merged` as properties
    (`merged_adapters` is set per instance); read on the class, once per class (`hasattr` on each
    module goes through `nn.Module.__getattr__`, a Python call per module and check)."""
    return all(isinstance(getattr(cls, name, None), property) for name in ("active_adapters", "disable_adapters", "merged"))
