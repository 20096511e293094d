"""The shared-state guard's parts: the tiny models every test shares (built once per process) and the
process-wide torch settings a test may change. The root conftest's autouse `shared_state_unchanged` fails
the test that leaves either changed."""

from __future__ import annotations


class TinyModels:
    """Builds each tiny model on first use and keeps it for the session (same seed: same weights).

    The models are shared by every test (and their oracle answers are cached), so a test that changes
    one must work on a copy: `changed_models` names any model whose weights, buffers, config or mode
    differ from when it was built, and the autouse `shared_state_unchanged` fails the test that did it.
    """

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], object] = {}
        self._built_as: dict[tuple[str, str], tuple[dict, str, bool]] = {}

    def forget(self) -> None:
        """Drop every built model: each is rebuilt, as it was first built, on its next use."""
        self._models.clear()
        self._built_as.clear()

    def __call__(self, name: str, attn_implementation: str = "sdpa"):
        from autobucket.models import build_tiny_model

        key = (name, attn_implementation)
        if key not in self._models:
            model = build_tiny_model(name, attn_implementation=attn_implementation)
            self._models[key] = model
            self._built_as[key] = _snapshot(model)
        return self._models[key]

    def changed_models(self) -> list[str]:
        """'name (what changed)' for every built model that is no longer as it was built."""
        changed = []
        for key, model in self._models.items():
            tensors, config, training = self._built_as[key]
            what = [
                *(["weights or buffers"] if not _same_tensors(tensors, _tensors_of(model)) else []),
                *(["config"] if model.config.to_json_string() != config else []),
                *(["train/eval mode"] if model.training != training else []),
            ]
            if what:
                changed.append(f"{key[0]} [{key[1]}] ({', '.join(what)})")
        return changed


def _tensors_of(model) -> dict:
    """Parameters and every buffer (non-persistent ones too: rotary inv_freq is not in state_dict)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _snapshot(model) -> tuple[dict, str, bool]:
    tensors = {name: tensor.detach().clone() for name, tensor in _tensors_of(model).items()}
    return tensors, model.config.to_json_string(), model.training


def _same_tensors(before: dict, now: dict) -> bool:
    import torch

    return before.keys() == now.keys() and all(
        before[name].dtype == now[name].dtype and torch.equal(before[name], now[name]) for name in before
    )


def torch_process_state() -> dict[str, object]:
    """The process-wide torch settings a test may change; a test that leaves one changed moves the
    numbers of whichever tests run after it in its process (which ones depends on the test order)."""
    import torch

    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.mkldnn.matmul.fp32_precision": getattr(mkldnn_matmul, "fp32_precision", None),
    }


def changed_process_state(before: dict[str, object], after: dict[str, object]) -> list[str]:
    return [f"{name}: {before[name]!r} -> {after[name]!r}" for name in before if after[name] != before[name]]

