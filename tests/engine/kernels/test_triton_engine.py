"""The Triton kernel set inside the engine, on the CPU: the tests' switch (`forced_on_cpu`) runs it on
CPU tensors through Triton's interpreter, so the engine and the trainer's scope take the very code paths
a CUDA model takes. Oracle: the trainer's teacher-forced forward under `autobucket.invariant(model)` with
the same switch; every sampled token's rollout logprob must equal it bitwise (fp32, a 2-layer tiny Llama,
chunked prefill and decode). Controls: the same forward on the CPU kernel set, and unscoped, differ."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels then run on CPU tensors

import contextlib
import copy
import threading

import pytest
import torch
from workloads import random_prompts

pytest.importorskip("triton")

from autobucket import Rollout, RolloutConfig, SamplingConfig, invariant, trainer_logprobs  # noqa: E402
from autobucket.costs.coefficients import CostCoefficients  # noqa: E402
from autobucket.engine.batching.prefill import positions_from_mask  # noqa: E402
from autobucket.engine.intercept.functions import interceptors_installed  # noqa: E402
from autobucket.engine.intercept.kernel_sets import runs_triton_set  # noqa: E402
from autobucket.engine.intercept.triton_set import forced_on_cpu  # noqa: E402
from autobucket.engine.trainer_logprobs import teacher_forced_batch  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread")]

LENGTHS = [5, 19, 9]


def rollout(model, prompts):
    """Chunked prefill (8 tokens a forward) and decode, 2 rows at a time -> (completions, logprobs)."""
    config = RolloutConfig(
        route="bucketed", kernels="invariant", persist_costs=False, prefill_max_tokens=8, costs=CostCoefficients()
    )  # fixed coefficients: no timing probe (each is a rollout, slow under the interpreter)
    sampling = SamplingConfig(
        max_new_tokens=4, temperature=1.0, seed=[0, 1, 2], logprobs=True, continuous_batch_size=2, eos_token_id=[]
    )
    result = Rollout(model, config=config).generate(prompts, sampling)
    return result.tokens, result.logprobs


def trainer_side(model, prompts, completions, scope) -> torch.Tensor:
    ids, mask, width = teacher_forced_batch(prompts, completions)
    with scope:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    return trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:], 1.0).detach().float()


def max_abs_diff(trainer, completions, logprobs) -> float:
    return max(
        (trainer[row, : len(tokens)] - torch.tensor(lp)).abs().max().item()
        for row, (tokens, lp) in enumerate(zip(completions, logprobs, strict=True))
    )


def test_rollout_logprobs_equal_the_triton_scoped_trainer_forward_bitwise(tiny_models):
    model = copy.deepcopy(tiny_models("tiny-llama"))
    assert model.config.num_hidden_layers == 2
    prompts = random_prompts(LENGTHS, seed=5)
    with forced_on_cpu():
        assert runs_triton_set(torch.device("cpu"))
        completions, logprobs = rollout(model, prompts)
        triton_trainer = trainer_side(model, prompts, completions, invariant(model))
    assert max_abs_diff(triton_trainer, completions, logprobs) == 0.0
    # controls: the CPU kernel set's forward and the model's own forward are not the Triton set's
    assert max_abs_diff(trainer_side(model, prompts, completions, invariant(model)), completions, logprobs) > 0.0
    assert max_abs_diff(trainer_side(model, prompts, completions, contextlib.nullcontext()), completions, logprobs) > 0.0
    assert not interceptors_installed()  # the scope's routers are out again


def test_the_switch_is_per_thread_and_cpu_models_keep_the_cpu_set():
    seen = []
    with forced_on_cpu():
        thread = threading.Thread(target=lambda: seen.append(runs_triton_set(torch.device("cpu"))))
        thread.start()
        thread.join()
        assert runs_triton_set(torch.device("cpu"))
    assert seen == [False]
    assert not runs_triton_set(torch.device("cpu"))
    assert runs_triton_set(torch.device("cuda", 0))


def test_the_scope_routes_the_models_rms_norms_for_its_own_thread_only(tiny_models):
    """Inside the Triton scope the model's RMSNorm gives the Triton row kernel's bits; another thread's
    call at the same time, and any call after the scope, give the class's own forward's bits."""
    from autobucket.engine.intercept.triton_set import triton_kernels
    from autobucket.engine.kernels.triton.row_reductions import rms_norm

    model = tiny_models("tiny-llama")
    norm = model.model.layers[0].input_layernorm
    own_forward = type(norm).forward
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        builtin = own_forward(norm, hidden)
        kernel = rms_norm(hidden, norm.weight, norm.variance_epsilon)
        assert not torch.equal(builtin, kernel)  # control: the two computations differ in bits here
        other_thread = []
        with forced_on_cpu(), triton_kernels(model):
            assert torch.equal(norm(hidden), kernel)
            thread = threading.Thread(target=lambda: other_thread.append(norm(hidden)))
            thread.start()
            thread.join()
        assert torch.equal(other_thread[0], builtin)
        assert type(norm).forward is own_forward
        assert torch.equal(norm(hidden), builtin)


def shared_rollout(model, prompts):
    config = RolloutConfig(route="aligned", kernels="invariant", persist_costs=False, costs=CostCoefficients())
    sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, seed=3, n=2, logprobs=True, eos_token_id=[])
    with forced_on_cpu():
        result = Rollout(model, config=config).generate(prompts, sampling)
        completions = [tokens for per_prompt in result.tokens for tokens in per_prompt]
        logprobs = [lp for per_prompt in result.logprobs for lp in per_prompt]
        trainer = trainer_side(model, [p for p in prompts for _ in range(2)], completions, invariant(model))
    return result, max_abs_diff(trainer, completions, logprobs)


def test_samples_reading_one_shared_copy_on_the_triton_set_equal_the_trainer_forward_bitwise(
    tiny_models, always_share, monkeypatch
):
    """A prompt's n samples decode over one copy of its K/V (the Triton shared-prefix kernel); each sampled
    token's logprob equals the trainer's teacher-forced forward on the same set bitwise. Control: rows
    that read the shared copy as another prompt's (a wrong row-to-prefix map) break it."""
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompts = random_prompts([11, 7], seed=9)
    result, difference = shared_rollout(model, prompts)
    assert result.profile.plan["shared_prefix_attention"] == "triton"
    assert result.profile.shared_kv_rows == 4  # every sample read its prompt's one copy
    assert difference == 0.0

    from autobucket.engine.kernels.triton import shared_prefix_attention as kernel

    real = kernel.shared_prefix_decode_attention

    def other_prompts_prefix(*args):
        args = list(args)
        args[8] = args[8].flip(0)  # row_prefix: each row reads the other prompt's copy
        return real(*args)

    monkeypatch.setattr(kernel, "shared_prefix_decode_attention", other_prompts_prefix)
    assert shared_rollout(model, prompts)[1] > 0.0
