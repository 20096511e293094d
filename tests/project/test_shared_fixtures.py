"""The shared tiny models' guard (shared_state.TinyModels.changed_models): it must see each kind of change
a test can make to a model it was handed, or a test that mutates one would silently move the oracle
answers of every later test in its process (which tests those are depends on the test order)."""

from __future__ import annotations

import pytest
import torch
from shared_state import TinyModels


@pytest.mark.parametrize("change", ["weight", "buffer", "config", "mode", "dtype"])
def test_the_guard_names_a_changed_model_and_only_it(change):
    models = TinyModels()  # a private instance: the shared models stay untouched
    changed, untouched = models("tiny-llama"), models("tiny-gpt2")
    assert models.changed_models() == []
    with torch.no_grad():
        if change == "weight":
            changed.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-6
        elif change == "buffer":
            changed.model.rotary_emb.inv_freq.mul_(1.0 + 1e-6)
        elif change == "config":
            changed.config.rope_theta = 1234.0
        elif change == "mode":
            changed.train()
        else:
            changed.to(torch.bfloat16)
    assert untouched.config.model_type == "gpt2"
    assert len(models.changed_models()) == 1 and models.changed_models()[0].startswith("tiny-llama [sdpa]")


def test_the_guard_is_quiet_after_a_deepcopy_is_changed():
    import copy

    models = TinyModels()
    own = copy.deepcopy(models("tiny-qwen2"))
    with torch.no_grad():
        next(own.parameters()).add_(1.0)
    assert models.changed_models() == []


def test_a_changed_model_forgotten_is_rebuilt_as_first_built():
    """What the guard does after failing the culprit: the next test gets the model as it was built."""
    models = TinyModels()
    first = models("tiny-qwen2")
    built = {name: tensor.clone() for name, tensor in first.state_dict().items()}
    with torch.no_grad():
        next(first.parameters()).add_(1.0)
    assert models.changed_models() != []
    models.forget()
    rebuilt = models("tiny-qwen2")
    assert rebuilt is not first and models.changed_models() == []
    assert all(torch.equal(built[name], tensor) for name, tensor in rebuilt.state_dict().items())


@pytest.mark.parametrize("setting", ["threads", "grad", "default_dtype"])
def test_the_process_state_check_sees_a_changed_setting(setting):
    from shared_state import changed_process_state, torch_process_state

    before = torch_process_state()
    restore = {
        "threads": (torch.set_num_threads, torch.get_num_threads(), 3),
        "grad": (torch.set_grad_enabled, torch.is_grad_enabled(), not torch.is_grad_enabled()),
        "default_dtype": (torch.set_default_dtype, torch.get_default_dtype(), torch.float64),
    }[setting]
    setter, old, new = restore
    setter(new)
    try:
        leaked = changed_process_state(before, torch_process_state())
    finally:
        setter(old)
    assert len(leaked) == 1 and repr(new) in leaked[0]
    assert changed_process_state(before, torch_process_state()) == []


def test_the_suite_learns_costs_in_a_temporary_cache_not_the_users(isolated_cache_dir, tmp_path_factory):
    """A test's learned costs (and any cache entry) go to the session's temporary folder, never to
    ~/.cache/autobucket, which a user's own runs read."""
    import os
    from pathlib import Path

    from autobucket.models import CACHE_DIR_ENV

    root = Path(os.environ[CACHE_DIR_ENV])
    assert root == isolated_cache_dir and root.is_relative_to(tmp_path_factory.getbasetemp())
    assert root != Path.home() / ".cache" / "autobucket"
