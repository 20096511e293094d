"""Chat messages and a tokenizer's batch output as prompts: `Rollout.generate([[{"role": ..., "content": ...}, ...], ...])` and JSONL
"messages" lines of `autobucket generate` go through the tokenizer's chat template. Oracle: the same call
on the token ids transformers' own `apply_chat_template(..., tokenize=True)` gives (ready for the
assistant's answer; or continuing a last assistant message). Control: the messages' text without the
template gives other prompts. Bad input is refused by name, and the Rollout stays usable."""

from __future__ import annotations

import copy
import json

import pytest
from byte_tokenizer import byte_bpe_tokenizer
from oracles import hf_greedy

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

MODEL = "tiny-qwen2"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "abc dab fig"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hop lop"}],
    [{"role": "user", "content": "cab"}, {"role": "assistant", "content": "dib"}, {"role": "user", "content": "nap"}],
    [{"role": "user", "content": "pig"}, {"role": "assistant", "content": "bog ja"}],  # a prefilled answer, continued
]
SAMPLING = SamplingConfig(max_new_tokens=5, eos_token_id=[])


@pytest.fixture(scope="module")
def plain_tokenizer():
    return byte_bpe_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer(plain_tokenizer):
    tokenizer = copy.deepcopy(plain_tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def templated(tokenizer, messages) -> list[int]:
    """transformers' own: the assistant's turn opened, or the last assistant message continued."""
    continues = messages[-1]["role"] == "assistant"
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=not continues, continue_final_message=continues))  # fmt: skip


def test_conversations_generate_what_their_templated_ids_generate(tiny_models, chat_tokenizer):
    model = tiny_models(MODEL)
    rollout = Rollout(model, chat_tokenizer, RolloutConfig(route="aligned"))
    ids = [templated(chat_tokenizer, messages) for messages in CONVERSATIONS]
    assert rollout.generate(CONVERSATIONS, SAMPLING).tokens == rollout.generate(ids, SAMPLING).tokens
    assert rollout.generate(CONVERSATIONS, SAMPLING).tokens == hf_greedy(model, ids, 5)
    assert chat_tokenizer.decode(ids[3]).endswith("bog ja")  # continued: no closing tag, no new turn
    plain = [chat_tokenizer(" ".join(m["content"] for m in messages))["input_ids"] for messages in CONVERSATIONS]
    assert plain != ids  # control: the template is what made the prompts


@pytest.mark.parametrize(("prompts", "tokenizer", "message"), [
    ([[{"role": "user", "content": "ab"}]], None, "prompt 0 is chat messages but there is no tokenizer"),
    ([[{"role": "user", "content": "ab"}]], "plain", "prompt 0 is chat messages but the tokenizer has no chat template"),
    ([[3, 4], [{"content": "ab"}]], "chat", "prompt 1: message 0 must have a \"role\" string and a \"content\""),
    ([{"role": "user", "content": "ab"}], "chat", "prompt 0 is one chat message: pass each conversation as a list"),
])  # fmt: skip
def test_bad_conversations_are_refused_by_name(tiny_models, plain_tokenizer, chat_tokenizer, prompts, tokenizer, message):
    chosen = {None: None, "plain": plain_tokenizer, "chat": chat_tokenizer}[tokenizer]
    rollout = Rollout(tiny_models(MODEL), chosen, RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match=message):
        rollout.generate(prompts, SAMPLING)
    assert rollout.generate([[3, 4, 5]], SAMPLING).tokens == hf_greedy(tiny_models(MODEL), [[3, 4, 5]], 5)


def test_cli_messages_lines_are_templated_and_echoed(tiny_models, chat_tokenizer, tmp_path, capsys, monkeypatch):
    """JSONL "messages" lines beside text and ids; the output's "prompt" is the conversation as given."""
    from autobucket import models

    model = tiny_models(MODEL)
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: (model, chat_tokenizer))
    path = tmp_path / "prompts.jsonl"
    lines = [{"messages": messages} for messages in CONVERSATIONS] + [{"prompt_ids": [3, 4, 5]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--max-new-tokens", "5", "--quiet",
            "--generation-option", "eos_token_id=[]"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [templated(chat_tokenizer, messages) for messages in CONVERSATIONS] + [[3, 4, 5]]
    assert [row["tokens"] for row in rows] == hf_greedy(model, ids, 5)
    assert [row["prompt"] for row in rows[:4]] == CONVERSATIONS


@pytest.mark.parametrize(("line", "message"), [
    ({"messages": []}, '"messages" must be a non-empty list'),
    ({"messages": [{"role": "user"}]}, '"messages" must be a non-empty list'),
    ({"messages": [{"role": "user", "content": "a"}], "prompt": "a"}, 'give exactly one of "prompt"'),
])  # fmt: skip
def test_bad_messages_lines_name_their_line(tmp_path, capsys, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert main(["generate", "--model", MODEL, "--prompts", str(path)]) == 2
    assert f"prompts.jsonl:1: {message}" in capsys.readouterr().err


def test_a_tokenizers_left_padded_batch_output_is_its_unpadded_prompts(tiny_models, plain_tokenizer):
    """`rollout.generate(tokenizer(texts, padding=True, return_tensors="pt"))`, as `model.generate(**inputs)`
    is called: the same call as the unpadded ids; without a mask the rows are taken whole; a right-padded
    batch is refused naming the tokenizer setting."""
    tokenizer = copy.deepcopy(plain_tokenizer)
    tokenizer.padding_side = "left"
    texts = ["abc dab fig hop", "lop", "cab nap pig bog"]
    rollout = Rollout(tiny_models(MODEL), tokenizer, RolloutConfig(route="aligned"))
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert len({len(row) for row in ids}) > 1  # the batch output is padded
    expected = rollout.generate(ids, SAMPLING).tokens
    assert rollout.generate(tokenizer(texts, padding=True, return_tensors="pt"), SAMPLING).tokens == expected
    assert rollout.generate(tokenizer(texts, padding=True, return_tensors="np"), SAMPLING).tokens == expected
    whole = {"input_ids": tokenizer(texts[:1], return_tensors="pt")["input_ids"]}
    assert rollout.generate(whole, SAMPLING).tokens == expected[:1]
    tokenizer.padding_side = "right"
    with pytest.raises(ValueError, match=r"is right-padded \(ones, then zeros\): pad on the left"):
        rollout.generate(tokenizer(texts, padding=True, return_tensors="pt"), SAMPLING)
