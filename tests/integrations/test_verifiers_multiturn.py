"""A verifiers-style multi-turn environment rolling out against the in-process server (`engine.serve`)
through the `openai` client, as verifiers' environments do (model turn, environment reply, model turn ...).

verifiers itself is not installed: its 0.4 release pins `openai<3` (the project's server tests run the
`openai` 3.x client) and runs model calls through its own interception server and harness runtime, so
the same pattern is driven here with the `openai` client directly, both ways verifiers talks to a server:
- chat messages (`/v1/chat/completions`): every assistant turn's token ids are what the engine gives for
  the same templated chat context directly, and single-request HF `generate` (greedy); its text is their
  decoding. Control: another latest environment reply gives other tokens.
- token in, token out (`/v1/completions` with token-id prompts, sampled with a seed): each turn's prompt is
  the episode so far (prompt, model tokens, environment replies as ids); each turn's tokens equal
  `Rollout.generate` of that context, the episode's ids decode to the chat template's rendering of the same
  conversation, and the returned logprobs are bitwise a trainer's one teacher-forced forward of the whole
  episode under `autobucket.invariant` at the model's positions. Control: the model's tokens placed one
  position off no longer match that forward."""

from __future__ import annotations

import openai
import pytest
import torch
from byte_tokenizer import chat_tokenizer
from oracles import oracle_generate

from autobucket import Rollout, RolloutConfig, SamplingConfig, invariant, trainer_logprobs
from autobucket.prompts import conversation_ids
from autobucket.serving import AsyncEngine

pytestmark = pytest.mark.usefixtures("single_thread")

ARCH = "tiny-qwen2"
TURNS = 3
NEW_TOKENS = 8
SEED = 11
OPENING = [{"role": "system", "content": "answer in few words"}, {"role": "user", "content": "abc def gah"}]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def served(tiny_models, tokenizer, single_thread):
    model = tiny_models(ARCH)
    engine = AsyncEngine(model, tokenizer, RolloutConfig(kernels="invariant"), max_batch=4, max_model_len=256)
    server = engine.serve("127.0.0.1", 0)
    yield engine, server, model
    server.close()
    engine.close()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


def environment_reply(turn: int, said: str) -> str:
    """The environment's next message, from what the model said (a game's referee, a tool's result)."""
    return f"turn {turn} heard {len(said)} chars, {'odd' if len(said) % 2 else 'even'}: go on"


def test_chat_episode_turns_are_the_engines_tokens_for_the_templated_context(served, tokenizer):
    engine, server, model = served
    client, messages, turns = client_for(server), list(OPENING), []
    for turn in range(TURNS):
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        choice = chat.choices[0]
        turns.append((conversation_ids(tokenizer, messages), choice.token_ids, choice.message.content))
        messages += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": environment_reply(turn, choice.message.content)}]  # fmt: skip
    greedy = SamplingConfig(max_new_tokens=NEW_TOKENS)
    for context, tokens, text in turns:
        assert tokens == engine.submit(context, greedy).result().tokens
        assert tokens == oracle_generate(model, context, NEW_TOKENS)[0]
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    last_context = messages[: len(OPENING) + 2 * (TURNS - 1)]
    assert conversation_ids(tokenizer, last_context) == turns[-1][0]
    other_reply = conversation_ids(tokenizer, [*last_context[:-1], {"role": "user", "content": "ponder anew"}])
    assert engine.submit(other_reply, greedy).result().tokens != turns[-1][1]


def rendered_suffix(reply: str) -> str:
    """What the chat template writes after an assistant message, through the next generation prompt."""
    return f" <user> {reply} <assistant> "


def token_episode(client, tokenizer) -> tuple[list[int], list[tuple[int, list[int], list[float]]], list[dict]]:
    """(episode ids, per turn (where its tokens start, tokens, logprobs), the conversation as messages)."""
    episode, turns, messages = conversation_ids(tokenizer, OPENING), [], list(OPENING)
    for turn in range(TURNS):
        completion = client.completions.create(
            model="m", prompt=episode, max_tokens=NEW_TOKENS, temperature=1.0, seed=SEED + turn, logprobs=0
        )
        choice = completion.choices[0]
        turns.append((len(episode), choice.token_ids, choice.logprobs.token_logprobs))
        reply = environment_reply(turn, choice.text)
        messages += [{"role": "assistant", "content": choice.text}, {"role": "user", "content": reply}]
        episode = [*episode, *choice.token_ids]
        if turn < TURNS - 1:
            episode += tokenizer(rendered_suffix(reply), add_special_tokens=False)["input_ids"]
    return episode, turns, messages


def teacher_forced_logprobs(model, episode: list[int]) -> torch.Tensor:
    """A trainer's per-token logprobs of the whole episode [len - 1] (position i: token i + 1)."""
    ids = torch.tensor([episode])
    with torch.no_grad(), invariant(model):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return trainer_logprobs(logits[0, :-1], ids[0, 1:], 1.0).float()


def test_token_episode_round_trips_into_one_trainer_forward(served, tokenizer):
    engine, server, model = served
    episode, turns, messages = token_episode(client_for(server), tokenizer)
    assert all(len(tokens) == NEW_TOKENS for _, tokens, _ in turns), "a turn ended early: change the workload"
    rollout = Rollout(model, tokenizer, RolloutConfig(kernels="invariant"))
    for turn, (start, tokens, logprobs) in enumerate(turns):
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=SEED + turn, logprobs=True)
        alone = rollout.generate([episode[:start]], sampling)
        assert (tokens, logprobs) == (alone.tokens[0], alone.logprobs[0])
        assert episode[start : start + len(tokens)] == tokens
    rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False, continue_final_message=True)
    assert tokenizer.decode(episode) == rendered  # the ids are the conversation, turn for turn
    trainer = teacher_forced_logprobs(model, episode)
    for start, tokens, logprobs in turns:
        assert trainer[start - 1 : start - 1 + len(tokens)].tolist() == logprobs
    start, tokens, logprobs = turns[-1]  # control: the same tokens one position later in the episode
    shifted = teacher_forced_logprobs(model, [*episode[:start], episode[start - 1], *tokens])
    assert shifted[start : start + len(tokens)].tolist() != logprobs
