"""RayRollout on a local Ray cluster (2 CPUs, 2 workers, tiny Qwen2).

Oracle: a single-process `Rollout` with the same config and the same weights; every distributed
result must equal it token for token, whatever the sharding. Ray start-up dominates the runtime, so
the whole module shares one cluster and one RayRollout, and failure tests heal it in place.
"""

from __future__ import annotations

import os
import random
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from autobucket.config import RolloutConfig, SamplingConfig  # noqa: E402
from autobucket.distributed.ray_rollout import DistributedResult, RayRollout  # noqa: E402
from autobucket.engine.rollout import Rollout  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402
from autobucket.planning.sharding import plan_shards, prompt_cost_ms  # noqa: E402

# Factories defined here must reach the workers by value: the tests folder is not on their path.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RAISE_TOKEN, EXIT_TOKEN = 1000, 1001  # prompts use ids in [3, 1000): only marked prompts hold these
CONFIG = RolloutConfig(route="auto")
SAMPLING = SamplingConfig(max_new_tokens=8, continuous_batch_size=4)


def _fail_on_marked_prompt(module, args, kwargs) -> None:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or input_ids.shape[-1] < 2:  # decode steps see generated ids, not prompts
        return
    if (input_ids == RAISE_TOKEN).any():
        raise ValueError("marked prompt reached the model")
    if (input_ids == EXIT_TOKEN).any():
        os._exit(3)  # the worker process dies: Ray reports the actor dead


def marked_model(seed: int = 0):
    """tiny-qwen2 that raises on RAISE_TOKEN and kills its process on EXIT_TOKEN (prefill only)."""
    model = build_tiny_model("tiny-qwen2", seed=seed)
    model.register_forward_pre_hook(_fail_on_marked_prompt, with_kwargs=True)
    return model, None


def failing_factory():
    raise ValueError("factory cannot build the model")


def mixed_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, RAISE_TOKEN) for _ in range(rng.choice([2, 3, 5, 9, 17, 40]))] for _ in range(count)]


PROMPTS = mixed_prompts(13, seed=0)  # 13 > 2 workers x continuous_batch_size 4: every worker refills


@pytest.fixture(scope="session")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def rr(ray_cluster):
    with RayRollout(marked_model, num_workers=2, config=CONFIG) as rollout:
        yield rollout


def single_process(sampling: SamplingConfig = SAMPLING, prompts=PROMPTS, state_dict=None):
    model, _ = marked_model()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return Rollout(model, config=CONFIG).generate(prompts, sampling)


@pytest.fixture(scope="module")
def expected():
    return single_process()


@pytest.mark.parametrize("sharding", ["cost", "round_robin"])
def test_results_equal_a_single_process(rr, expected, sharding: str) -> None:
    rr.sharding = sharding
    try:
        result = rr.generate(PROMPTS, SAMPLING)
    finally:
        rr.sharding = "cost"
    assert isinstance(result, DistributedResult) and result.sharding == sharding
    assert result.tokens == expected.tokens
    assert result.finish_reasons == expected.finish_reasons
    # Each worker ran the shard the pure planner predicts, and the merged profile covers every prompt once.
    info = rr.worker_info()
    costs = [prompt_cost_ms(len(p), SAMPLING.max_new_tokens, info.geometry, info.costs) for p in PROMPTS]
    plan = plan_shards(costs, 2, sharding)
    assert plan.shards != plan_shards(costs, 2, "round_robin" if sharding == "cost" else "cost").shards
    assert [w.prompts for w in result.workers] == [len(shard) for shard in plan.shards]
    assert [w.predicted_ms for w in result.workers] == pytest.approx(list(plan.predicted_ms))
    assert result.predicted_imbalance == pytest.approx(plan.imbalance)
    assert all(w.measured_ms > 0 for w in result.workers) and result.measured_imbalance >= 1.0
    grouped = sorted(i for admission in result.profile.prefill_groups for group in admission for i in group)
    assert grouped == list(range(len(PROMPTS)))
    assert result.profile.output_tokens == sum(len(t) for t in expected.tokens)
    assert result.profile.total_ms >= max(w.measured_ms for w in result.workers)


def test_generate_padded_takes_the_trainer_layout(rr, expected) -> None:
    import torch

    prompts = PROMPTS[:6]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    assert rr.generate_padded(input_ids, attention_mask, SAMPLING).tokens == expected.tokens[:6]


def test_sampling_does_not_depend_on_the_sharding(rr) -> None:
    sampling = SamplingConfig(max_new_tokens=8, continuous_batch_size=4, temperature=1.0, seed=7, n=2, logprobs=True)
    want = single_process(sampling)
    result = rr.generate(PROMPTS, sampling)
    assert result.tokens == want.tokens
    flat = [value for prompt in result.logprobs for sample in prompt for value in sample]
    assert flat == pytest.approx([value for prompt in want.logprobs for sample in prompt for value in sample], abs=1e-4)
    # Negative control: the same prompts at other input positions draw other streams.
    shifted = rr.generate(PROMPTS[1:] + PROMPTS[:1], sampling)
    assert shifted.tokens[:-1] != result.tokens[1:]


def test_per_prompt_budgets_follow_their_prompts_into_the_shards(rr) -> None:
    """Each prompt keeps its own max_new_tokens in whichever shard it lands (a shard given the call's list,
    or its first entries, would fail on length or on the workers' list-length check)."""
    budgets = [1 + (7 * i) % 11 for i in range(len(PROMPTS))]
    sampling = SamplingConfig(max_new_tokens=budgets, continuous_batch_size=4, temperature=1.0, seed=3, eos_token_id=[])
    want = single_process(sampling)
    result = rr.generate(PROMPTS, sampling)
    assert result.tokens == want.tokens
    assert [len(t) for t in result.tokens] == budgets


def parity_of_the_prompt(batch_id: int, ids) -> list[int]:
    """prefix_allowed_tokens_fn: even ids for even prompt indices of the call, odd ones for odd."""
    return list(range(3 + (batch_id + 1) % 2, 1000, 2))


class BanEveryFifth:
    """A caller's logits processor: ids divisible by 5 never generated."""

    def __call__(self, input_ids, scores):
        scores[:, ::5] = float("-inf")
        return scores


def test_logits_processors_reach_the_shards_with_the_calls_prompt_indices(rr) -> None:
    """Processor options and a caller's processor travel to the workers (by value); prefix_allowed_tokens_fn
    gets each prompt's index in the whole call, not in its shard: the tokens equal one process's call.
    Control: the same prompts at other indices (what shard-local batch ids would give) get other tokens."""
    from transformers import LogitsProcessorList

    options = {"no_repeat_ngram_size": 2, "suppress_tokens": [7, 11], "prefix_allowed_tokens_fn": parity_of_the_prompt,
               "logits_processor": LogitsProcessorList([BanEveryFifth()])}  # fmt: skip
    model, _ = marked_model()
    want = Rollout(model, config=CONFIG).generate(PROMPTS, SAMPLING, **options)
    result = rr.generate(PROMPTS, SAMPLING, **options)
    assert result.tokens == want.tokens
    assert all(t % 5 != 0 and t not in (7, 11) and t % 2 == i % 2 for i, tokens in enumerate(want.tokens) for t in tokens)
    shifted = Rollout(model, config=CONFIG).generate(PROMPTS[1:], SAMPLING, **options)
    assert shifted.tokens != want.tokens[1:]


def test_a_worker_error_propagates_with_its_type_and_the_next_call_works(rr, expected) -> None:
    marked = [list(p) for p in PROMPTS]
    marked[0][0] = RAISE_TOKEN  # first prompt of its shard: that worker fails at its first prefill
    long_sampling = SamplingConfig(max_new_tokens=300, continuous_batch_size=4)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="marked prompt reached the model") as caught:
        rr.generate(marked, long_sampling)
    failed_s = time.perf_counter() - started
    assert isinstance(caught.value, ray.exceptions.RayTaskError)
    assert "_fail_on_marked_prompt" in str(caught.value)  # the worker's traceback comes along
    started = time.perf_counter()
    rr.generate(PROMPTS, long_sampling)
    # The other shard was cancelled at its next forward, not run to the end (~50x faster here; a
    # ratio, not an absolute time, because the machine is shared).
    assert failed_s < (time.perf_counter() - started) / 4
    assert rr.generate(PROMPTS, SAMPLING).tokens == expected.tokens


def test_bad_prompts_fail_on_the_driver_naming_the_input_index(rr) -> None:
    bad = [list(p) for p in PROMPTS]
    bad[11][1] = 5000
    with pytest.raises(ValueError, match="prompt 11 has token id 5000"):
        rr.generate(bad, SAMPLING)
    with pytest.raises(ValueError, match="prompt 0 is a string but the Rollout has no tokenizer"):
        rr.generate(["text"], SAMPLING)  # strings are tokenised by worker 0; tiny models have no tokenizer
    empty = rr.generate([], SAMPLING)
    assert empty.tokens == [] and [w.prompts for w in empty.workers] == [0, 0]


def test_chat_conversations_are_templated_on_a_worker_as_in_one_process(rr) -> None:
    """The driver holds no tokenizer: chat messages go to worker 0 with the strings, and the call equals
    one process's on the same model and chat template."""
    import copy

    from byte_tokenizer import byte_bpe_tokenizer

    tokenizer = copy.deepcopy(byte_bpe_tokenizer())  # the shared one must keep no chat template
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}<assistant> "
    conversations = [[{"role": "user", "content": "abc dab"}], [{"role": "system", "content": "be"},
                                                               {"role": "user", "content": "hop lop"}]]  # fmt: skip
    want = Rollout(marked_model()[0], tokenizer, config=CONFIG).generate(conversations, SAMPLING)
    rr.update_weights(lambda: (marked_model()[0], tokenizer))
    try:
        assert rr.generate(conversations, SAMPLING).tokens == want.tokens
    finally:
        rr.update_weights(marked_model)


def test_update_weights_matches_one_process_and_survives_a_dead_worker(rr, expected) -> None:
    state_dict = build_tiny_model("tiny-qwen2", seed=1).state_dict()
    want = single_process(state_dict=state_dict)
    assert want.tokens != expected.tokens  # negative control: the new weights change the outputs
    rr.update_weights(state_dict)
    assert rr.generate(PROMPTS, SAMPLING).tokens == want.tokens
    crash = [list(p) for p in PROMPTS]
    crash[0][0] = EXIT_TOKEN
    with pytest.raises(ray.exceptions.RayActorError):
        rr.generate(crash, SAMPLING)
    # The dead worker was replaced with the factory *and* the updated weights (Ray's max_restarts would
    # rerun the constructor only and silently serve the old weights).
    assert rr.generate(PROMPTS, SAMPLING).tokens == want.tokens
    with pytest.raises(ValueError, match="factory cannot build the model"):
        rr.update_weights(failing_factory)
    rr.update_weights(marked_model)
    assert rr.generate(PROMPTS, SAMPLING).tokens == expected.tokens


def test_shutdown_kills_the_actors(ray_cluster) -> None:
    with RayRollout("tiny-qwen2", num_workers=1, worker_options={"num_cpus": 0}) as rollout:
        actor = rollout._actors[0]
        assert rollout.config == RolloutConfig(route="auto")  # the default every entry point names
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.describe.remote(), timeout=30)
    with pytest.raises(RuntimeError, match="shut down"):
        rollout.generate([[5, 6]])


def test_missing_ray_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "autobucket\[ray\]"'):
        RayRollout("tiny-qwen2")


def test_bad_arguments_are_rejected_before_any_actor_starts() -> None:
    with pytest.raises(ValueError, match="num_workers=0"):
        RayRollout("tiny-qwen2", num_workers=0)
    with pytest.raises(ValueError, match="sharding='random'"):
        RayRollout("tiny-qwen2", sharding="random")
    with pytest.raises(TypeError, match="model_factory must be"):
        RayRollout(42)
    with pytest.raises(ValueError, match="num_workers=True"):
        RayRollout("tiny-qwen2", num_workers=True)
    with pytest.raises(ValueError, match="torch_threads=0"):
        RayRollout("tiny-qwen2", torch_threads=0)
    # A model path that does not exist is named on the driver, with what a name may be.
    with pytest.raises(ValueError, match=r"model './no-such-model' does not exist: pass a model folder.*smollm2"):
        RayRollout("./no-such-model")


def test_a_workers_cancel_hook_leaves_the_direct_decode_step_on() -> None:
    # The hook sits on the input embeddings, which every forward runs; on the model it would bypass the
    # direct step (which refuses models with hooks on the modules it skips) in every Ray worker.
    from autobucket.distributed.worker import Worker, stop_if_cancelled
    from autobucket.engine.decode.eligibility import installed_release_verified
    from autobucket.engine.decode.parts import LlamaParts

    worker = Worker(RolloutConfig(), torch_threads=None)
    worker.load("tiny-llama")
    model = worker.rollout.model
    assert list(model.get_input_embeddings()._forward_pre_hooks.values()) == [stop_if_cancelled]
    assert not model._forward_pre_hooks
    if installed_release_verified():
        assert LlamaParts.of(model) is not None
