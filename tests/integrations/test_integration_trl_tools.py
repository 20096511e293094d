"""Tool calling in TRL's real GRPO trainer (trl 1.16) through `AutobucketGRPOTrainer`.

TRL's `_tool_call_loop` parses each completion (`parse_response` with the tokenizer's
`response_template`), runs the tools, and calls `_generate_single_turn` again with prompt + completion +
tool-result ids and `num_generations=1`. Nothing here is patched on TRL's side: the word-level tokenizer
has a chat template that renders tool calls and tool messages, and a `response_template` whose tool call
is "the word before end-of-turn" (`... w17 <eos>` calls `echo(word="w17")`); the end-of-turn token is one
the tiny model emits greedily for some prompts only, so some conversations call the tool and some do not.

Oracles: the stock `GRPOTrainer` with the same tools (greedy: identical completions at every turn of every
step, identical tool masks and final weights), with and without the prefix cache. With the cache, every
tool turn reuses exactly the K/V the previous turn finished (`cached_prompt_tokens` equals the cached
sequence lengths it extends), and no first turn reuses anything (the cache lives for one generation
batch: the steps here repeat the same prompts, so a stale entry after an optimizer step would hit).
Sampling: later turns generate one sample per conversation, each with its own seed, and their logprobs
match TRL's recomputed ones at the model's tokens. With `kernels="invariant"` the completions stay the
stock trainer's over the steps (TRL's fused AdamW bumps no version counter, so the packed weights must be
dropped per step; without that the second step generates from the first step's weights)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from workloads import VOCAB, firing_eos_candidates  # noqa: E402

from autobucket import RolloutConfig  # noqa: E402
from autobucket.engine.rollout import Rollout  # noqa: E402
from autobucket.integrations import trl as autobucket_trl  # noqa: E402
from autobucket.integrations.trl import AutobucketGRPOTrainer, make_rollout_func  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

USER, ASSISTANT, TOOL = "w3", "w4", "w5"  # turn headers; prompts use words from w10 on
PROMPT_WORDS = (30, 22, 41, 18)
NUM_GENERATIONS = 2
MAX_COMPLETION = 16
TOOL_RESULT_WORDS = 2  # echo's answer; a tool turn's suffix is TOOL + these + ASSISTANT

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}" + USER + " {{ m.content }} "
    "{% elif m.role == 'assistant' %}" + ASSISTANT + " {{ m.content }} "
    "{% for call in m.tool_calls or [] %}{{ call.function.name }} {{ call.function.arguments | tojson }} {% endfor %}"
    "{{ eos_token }} "
    "{% elif m.role == 'tool' %}" + TOOL + " {{ m.content }} "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + " {% endif %}"
)


def response_template(eos_word: str) -> dict:
    """transformers' response template: the word right before end-of-turn is a call of `echo`."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": rf"\b{ASSISTANT}\b\s*",
        "fields": {
            "tool_calls": {
                "open_pattern": rf"(?P<word>w\d+) (?={eos_word}\b)",
                "close": eos_word,
                "content": "text",
                "transform": [{"type": "function", "function": {"name": "echo", "arguments": {"word": "{word}"}}}],
            },
            "content": {"close_pattern": rf"\s*{eos_word}\b\s*", "content": "text"},
        },
    }


def tool_tokenizer(eos_id: int | None):
    """Word-level tokenizer over the tiny model's vocabulary (id i <-> "w{i}") with the tool chat template
    and, for an EOS word, the response template (None: "</s>", for probing the model before EOS is chosen)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos_word = "</s>" if eos_id is None else f"w{eos_id}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token=eos_word)
    tokenizer.chat_template = CHAT_TEMPLATE
    if eos_id is not None:
        tokenizer.response_template = response_template(eos_word)
    return tokenizer


def echo(word: str) -> str:
    """Answer a vocabulary word with two others.

    Args:
        word: a vocabulary word such as w17.
    """
    n = int(word[1:]) if word[1:].isdigit() else 0
    return f"w{10 + (7 * n) % 1000} w{10 + (13 * n) % 1000}"


def conversations(seed: int = 3) -> list[list[dict]]:
    rng = random.Random(seed)
    texts = [" ".join(f"w{rng.randrange(10, VOCAB)}" for _ in range(n)) for n in PROMPT_WORDS]
    return [[{"role": "user", "content": text}] for text in texts]


@pytest.fixture(scope="module")
def eos_id() -> int:
    """An end-of-turn token greedy decoding emits early enough for some prompts (their tool result then
    fits the completion budget) and never for others."""
    model, tokenizer = build_tiny_model("tiny-qwen2"), tool_tokenizer(None)
    outputs = []
    for messages in conversations():
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_COMPLETION, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
    fits = MAX_COMPLETION - (TOOL_RESULT_WORDS + 2)  # completion tokens that leave room for the tool result
    for candidate in firing_eos_candidates(outputs):
        if candidate >= 10 and any(candidate in out[:fits] for out in outputs):
            return candidate
    raise AssertionError("no token ends some greedy completions early and not all: change the prompts")


@dataclass
class Run:
    turns: list  # per _generate_single_turn call: (num_generations, prompt ids, completion ids as generated)
    outputs: list  # per generation batch: TRL's output dict
    profiles: list  # per turn: autobucket's Profiles of its generate calls ([] for the stock trainer)
    weights: dict
    log_history: list
    generate_calls: list  # per Rollout.generate call: (prompts, n, seeds, max_new_tokens); [] for the stock trainer
    trainer: object


def grpo_config(tmp_path, greedy: bool, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=len(PROMPT_WORDS) * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=3, learning_rate=0.05,
        logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
        shuffle_dataset=False, temperature=1.0, top_k=0, top_p=1.0, dataloader_num_workers=0,
        max_tool_calling_iterations=2,
    )
    if greedy:  # identical samples give zero advantages: the entropy bonus still moves the weights
        settings.update(generation_kwargs={"do_sample": False}, entropy_coef=0.5)
    settings.update(overrides)
    return GRPOConfig(**settings)


def recording(trainer_cls, turns: list):
    class Recording(trainer_cls):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            completions, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
            # copies: TRL's tool loop extends and truncates these lists in place afterwards
            turns.append((num_generations, [list(p) for p in prompt_ids], [list(c) for c in completions]))
            return completions, logprobs

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.recorded_outputs = [*getattr(self, "recorded_outputs", []), output]
            # autobucket's Profiles of this batch, one list per turn (the stock trainer has none)
            self.recorded_turns = [*getattr(self, "recorded_turns", []), list(getattr(self, "autobucket_turns", []))]
            return output

    return Recording


def run_grpo(trainer_cls, tmp_path, eos_id, monkeypatch=None, greedy=True, config_overrides=None, **trainer_kwargs) -> Run:
    generate_calls: list = []
    if monkeypatch is not None:  # a spy on what the adapter asks autobucket for; generation itself is untouched
        real_generate = Rollout.generate

        def spy(self, prompts, sampling=None, **overrides):
            generate_calls.append(([list(p) for p in prompts], sampling.n, list(sampling.seed), sampling.max_new_tokens))
            return real_generate(self, prompts, sampling, **overrides)

        monkeypatch.setattr(Rollout, "generate", spy)
    turns: list = []
    model = build_tiny_model("tiny-qwen2")
    trainer = recording(trainer_cls, turns)(
        model=model,
        reward_funcs=lambda completion_ids, **kwargs: [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids],
        args=grpo_config(tmp_path, greedy, **(config_overrides or {})),
        train_dataset=Dataset.from_dict({"prompt": conversations()}), processing_class=tool_tokenizer(eos_id),
        tools=[echo], **trainer_kwargs,
    )
    trainer.train()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    profiles = [turn for batch in trainer.recorded_turns for turn in batch]
    return Run(turns, trainer.recorded_outputs, profiles, weights, trainer.state.log_history, generate_calls, trainer)


def tool_turns(run: Run) -> list:
    return [turn for turn in run.turns if turn[0] == 1]


@pytest.fixture(scope="module")
def stock(tmp_path_factory, eos_id) -> Run:
    run = run_grpo(GRPOTrainer, tmp_path_factory.mktemp("stock"), eos_id)
    # the oracle is only worth something if tools really ran and the weights really moved
    assert tool_turns(run), "no completion called the tool: the workload does not exercise TRL's tool loop"
    assert any(h.get("tools/call_frequency", 0) > 0 for h in run.log_history)
    assert any((output["tool_mask"] == 0).any() for output in run.outputs if "tool_mask" in output)
    initial = build_tiny_model("tiny-qwen2").state_dict()
    assert any(not torch.equal(run.weights[k], initial[k]) for k in initial), "training did not move the weights"
    called = sum(len(prompts) for _, prompts, _ in tool_turns(run))
    first = sum(len(prompts) for n, prompts, _ in run.turns if n == NUM_GENERATIONS)
    assert 0 < called < first, "every or no conversation called the tool: both kinds must occur"
    return run


def assert_same_training(got: Run, want: Run) -> None:
    assert [n for n, _, _ in got.turns] == [n for n, _, _ in want.turns]
    assert [prompts for _, prompts, _ in got.turns] == [prompts for _, prompts, _ in want.turns]
    assert [completions for _, _, completions in got.turns] == [completions for _, _, completions in want.turns]
    for ours, theirs in zip(got.outputs, want.outputs, strict=True):
        assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
        assert torch.equal(ours["tool_mask"], theirs["tool_mask"])
    different = [k for k in want.weights if not torch.equal(got.weights[k], want.weights[k])]
    assert not different, f"final weights differ in {different[:3]}"


def expected_cached_tokens(run: Run) -> list[int]:
    """Per turn: the prompt tokens the prefix cache should serve. The cache holds every finished sequence
    of the batch's earlier turns (prompt + generated tokens but the last, which was never fed); a tool turn's
    conversation continues the one its previous turn finished, so it reuses all of that."""
    expected, finished = [], []
    for n, prompts, completions in run.turns:
        if n == NUM_GENERATIONS:  # a new generation batch: its cache starts empty
            finished = []
        reused = 0
        for prompt in prompts:
            lengths = [len(seq) for seq in finished if len(seq) < len(prompt) and prompt[: len(seq)] == seq]
            reused += max(lengths, default=0)
        expected.append(reused)
        finished += [prompt + completion[:-1] for prompt, completion in zip(prompts, completions, strict=True)]
    return expected


@pytest.mark.parametrize("cache_mb", [0.0, 64.0], ids=["no-cache", "prefix-cache"])
def test_greedy_tool_grpo_matches_stock_trainer(cache_mb, stock, tmp_path, eos_id, monkeypatch):
    config = RolloutConfig(route="auto", prefix_cache_mb=cache_mb)
    if cache_mb:
        run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, monkeypatch, rollout_config=config)
    else:
        with pytest.warns(UserWarning, match="prefix_cache_mb=0: every tool-calling turn prefills"):
            run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, monkeypatch, rollout_config=config)
    assert_same_training(run, stock)

    # one generate per turn; a tool turn samples each conversation once (identical greedy conversations
    # included), each with its own stream key
    assert len(run.generate_calls) == len(run.turns)
    for (n, prompts, _), (asked, asked_n, seeds, _) in zip(run.turns, run.generate_calls, strict=True):
        if n == 1:
            assert asked == prompts and asked_n == 1 and len(set(seeds)) == len(prompts)
        else:
            assert asked == prompts[::NUM_GENERATIONS] and asked_n == NUM_GENERATIONS
    assert any(len(set(map(tuple, prompts))) < len(prompts) for _, prompts, _ in tool_turns(run))

    # what each turn took from the prefix cache
    cached = [profile.cached_prompt_tokens for turn in run.profiles for profile in turn]
    if not cache_mb:
        assert cached == [0] * len(run.turns)
        return
    expected = expected_cached_tokens(run)
    assert cached == expected
    assert all(expected[i] > 0 for i, (n, _, _) in enumerate(run.turns) if n == 1)
    assert all(expected[i] == 0 for i, (n, _, _) in enumerate(run.turns) if n == NUM_GENERATIONS)
    logged = [h["autobucket/cached_prompt_tokens"] for h in run.log_history if "autobucket/cached_prompt_tokens" in h]
    assert len(logged) == 3 and sum(logged) == sum(expected)


def test_trainer_with_tools_defaults_to_a_prefix_cache(tmp_path, eos_id):
    def build(**kwargs):
        return AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=grpo_config(tmp_path, True),
            train_dataset=Dataset.from_dict({"prompt": conversations()}), processing_class=tool_tokenizer(eos_id),
            **kwargs,
        )

    assert build(tools=[echo]).rollout_config.prefix_cache_mb == autobucket_trl.TOOL_PREFIX_CACHE_MB
    assert build().rollout_config.prefix_cache_mb == 0  # without tools, the default config is untouched
    explicit = RolloutConfig(route="aligned", prefix_cache_mb=8.0)
    assert build(tools=[echo], rollout_config=explicit).rollout_config is explicit


def test_sampled_tool_turns_one_sample_per_conversation_with_matching_logprobs(tmp_path, eos_id, monkeypatch):
    # a low temperature keeps the sampled completions near the greedy ones, so tools are called;
    # num_iterations=2 makes TRL recompute old_per_token_logps with its own forward
    temperature = 0.05
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, monkeypatch, greedy=False,
        config_overrides={"temperature": temperature, "num_iterations": 2},
        rollout_config=RolloutConfig(route="auto", prefix_cache_mb=64.0),
    )  # fmt: skip
    assert tool_turns(run), "no sampled completion called the tool"
    for (n, _, _), (_, asked_n, seeds, _) in zip(run.turns, run.generate_calls, strict=True):
        assert asked_n == (1 if n == 1 else NUM_GENERATIONS)
        assert len(set(seeds)) == len(seeds)
    tool_profiles = [p for turn, (n, _, _) in zip(run.profiles, run.turns, strict=True) if n == 1 for p in turn]
    assert all(profile.cached_prompt_tokens > 0 for profile in tool_profiles)
    post_tool = 0
    for output in run.outputs:
        mask = (output["completion_mask"] * output["tool_mask"]).bool()
        tool_tokens = (output["completion_mask"] * (1 - output["tool_mask"])).bool()
        ours, trl = output["sampling_per_token_logps"], output["old_per_token_logps"]
        # fp32 rounding of the logits (different forward shapes) is scaled by 1 / temperature; a logprob
        # of another position or another token would be off by orders of magnitude more
        torch.testing.assert_close(ours[mask], trl[mask], rtol=1e-5 / temperature, atol=1e-5 / temperature)
        assert (ours[mask] - trl[mask]).abs().median() < 2e-6 / temperature
        assert torch.all(ours[tool_tokens] == 0.0)  # tool-result tokens were not sampled
        post_tool += int((mask & (tool_tokens.int().cumsum(dim=1) > 0)).sum())  # a later turn's tokens
    assert post_tool > 0, "no later-turn tokens were compared"


def test_rollout_func_with_tools_is_rejected(tmp_path, eos_id):
    trainer = GRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=grpo_config(tmp_path, True),
        train_dataset=Dataset.from_dict({"prompt": conversations()}), processing_class=tool_tokenizer(eos_id),
        tools=[echo], rollout_func=make_rollout_func(),
    )
    with pytest.raises(ValueError, match="tools with make_rollout_func"):
        trainer.train()


def test_invariant_kernels_generate_with_the_updated_weights(stock, tmp_path, eos_id, monkeypatch):
    """TRL's default optimizer (fused AdamW) updates the weights without bumping their version counters;
    the trainer still drops the rollout's packed weights (and the trainer scope's) after every step, so
    every step's completions are the updated policy's: the stock trainer's, turn by turn."""
    config = RolloutConfig(route="auto", prefix_cache_mb=64.0, kernels="invariant")
    run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, monkeypatch, rollout_config=config)
    assert run.trainer.args.optim == "adamw_torch_fused"  # the optimizer whose writes counters miss
    assert [completions for _, _, completions in run.turns] == [completions for _, _, completions in stock.turns]


def test_tool_turn_near_the_context_end_generates_what_fits(tmp_path, eos_id, monkeypatch):
    """A later turn's conversation (prompt + completion + tool result) may leave fewer than
    max_completion_length positions: it generates what fits (TRL keeps no more of it), where a first turn
    raises; a conversation that fills the whole context is an error naming the settings to lower."""
    generate_calls: list = []
    real_generate = Rollout.generate

    def spy(self, prompts, sampling=None, **overrides):
        generate_calls.append(sampling.max_new_tokens)
        return real_generate(self, prompts, sampling, **overrides)

    monkeypatch.setattr(Rollout, "generate", spy)
    trainer = AutobucketGRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=grpo_config(tmp_path, True),
        train_dataset=Dataset.from_dict({"prompt": conversations()}), processing_class=tool_tokenizer(eos_id),
        tools=[echo],
    )
    limit = trainer.model.config.max_position_embeddings
    rng = random.Random(0)
    near_end = [rng.randrange(10, VOCAB) for _ in range(limit - 6)]  # 6 positions left, budget 16
    short = near_end[:40]
    with pytest.raises(ValueError, match=rf"prompt 0 has {limit - 6} tokens"):
        trainer._generate_single_turn([near_end], None, {}, 1)  # a first turn
    trainer.autobucket_turns = [[]]  # as after this batch's first turn
    completions, _ = trainer._generate_single_turn([near_end, short], None, {}, 1)
    assert len(completions[0]) <= 6 and 0 < len(completions[1]) <= MAX_COMPLETION
    assert generate_calls == [[6, MAX_COMPLETION]]  # one call, each conversation with its own budget
    with pytest.raises(ValueError, match=rf"conversation 0 has {limit} tokens, the model's whole context"):
        trainer._generate_single_turn([near_end + [11] * 6], None, {}, 1)
