"""The phases of `benchmarks/gpu_check.sh`, one per process (each time-boxed by the shell):

  env       versions, device, TF32 (turned off for the kernel phases)
  kernels   the Triton kernels' batch invariance on the hardware, fp32 and bf16, with negative controls
  mismatch  zero mismatch end to end: a random-weight Qwen2.5-0.5B geometry, GRPO-shaped (n = 8, T = 1),
            k3 and max |dlogp| of rollout vs trainer, invariant kernels vs default
  speed     one process, contenders interleaved: HF generate, transformers' generate_batch, Auto on the
            model's own ops (kernels="torch", the GPU's default) eager and with CUDA graphs, Auto with the
            invariant kernels eager and with CUDA graphs; the JSON is rewritten after every round
  step      the decode step alone, 64 rows over a context of 1,024: eager vs replayed from a CUDA graph,
            interleaved, on the model's own ops and on the invariant kernels (their logits compared)
  table     the phases' JSON files -> summary.json and a table

`--rehearse`: the same code on the CPU at toy sizes, the Triton kernels under the interpreter
(TRITON_INTERPRET=1, set by the shell) and forced onto CPU tensors, CUDA graphs on their CPU stand-in
(`graphs_on_cpu`: the step traced and replayed); fp32 only (the interpreter's bf16 is wrong)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
QWEN_CONFIG = REPO / "benchmarks" / "configs" / "qwen2.5-0.5b.json"
TOY_GEOMETRY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}  # fmt: skip


def device(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda")


def tf32_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def forced(rehearse: bool):
    """The Triton set on CPU tensors for the rehearsal; nothing to force on a GPU."""
    import contextlib

    from autobucket.engine.intercept.triton_set import forced_on_cpu

    return forced_on_cpu() if rehearse else contextlib.nullcontext()


def graphs_forced(rehearse: bool):
    """CUDA graphs on their CPU stand-in for the rehearsal; a GPU captures real ones."""
    import contextlib

    from autobucket.engine.decode.graph_capture import graphs_on_cpu

    return graphs_on_cpu() if rehearse else contextlib.nullcontext()


# ------------------------------------------------------------------ env
TRITON_FLOOR = "3.6"  # the oldest triton the kernels were run (interpreter) and compiled (sm_80 / sm_90) on


def declared_floors() -> tuple[str | None, list[str]]:
    """pyproject.toml's requires-python and runtime dependencies (None, []: python < 3.11 has no tomllib)."""
    try:
        import tomllib
    except ImportError:
        return None, []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["requires-python"], project["dependencies"]


def floor_problems(python_spec: str | None, dependencies: list[str]) -> list[str]:
    """What this environment lacks of what pyproject declares, and of the check's own needs (triton)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    problems = []
    if python_spec and platform.python_version() not in SpecifierSet(python_spec):
        problems.append(f"python {platform.python_version()} does not satisfy requires-python {python_spec}")
    for line in [*dependencies, f"triton>={TRITON_FLOOR}"]:
        requirement = Requirement(line)
        try:
            found = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed (pyproject: {line})")
            continue
        if not requirement.specifier.contains(found.split("+")[0], prereleases=True):
            problems.append(f"{requirement.name} {found} does not satisfy {line}")
    return problems


def phase_env(rehearse: bool) -> dict:
    """The versions found, the device, and whether they meet pyproject's floors (the check stops if not)."""
    import numpy
    import transformers

    info = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "transformers": transformers.__version__, "numpy": numpy.__version__,
            "rehearse": rehearse, "cuda": torch.cuda.is_available()}  # fmt: skip
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as error:
        info["triton"] = f"missing: {error}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["tf32_matmul_default"] = torch.backends.cuda.matmul.allow_tf32
    python_spec, dependencies = declared_floors()
    info["floors_checked"] = python_spec is not None
    info["floor_problems"] = floor_problems(python_spec, dependencies)
    if rehearse and not torch.cuda.is_available():
        info["runs"] = "rehearsal: CPU tensors, the Triton kernels under the interpreter, toy sizes, fp32"
    else:
        info["runs"] = f"GPU: {info.get('gpu', 'none visible')}, compiled Triton kernels, fp32 + bf16, TF32 off"
    info["ok"] = not info["floor_problems"] and (rehearse or info["cuda"])
    return info


def describe_env(info: dict) -> str:
    """Lines a person reads before the phases start."""
    lines = [
        f"python {info['python']} ({info['executable']}), torch {info['torch']} (CUDA {info['torch_cuda']}), "
        f"triton {info['triton']}, transformers {info['transformers']}, numpy {info['numpy']}",
        f"runs: {info['runs']}",
    ]
    if not info["floors_checked"]:
        lines.append("floors: not checked (python < 3.11 has no tomllib to read pyproject.toml)")
    elif info["floor_problems"]:
        lines += [f"floor not met: {problem}" for problem in info["floor_problems"]]
    else:
        lines.append(f"floors: pyproject.toml's requirements and triton>={TRITON_FLOOR} met")
    if not info["rehearse"] and not info["cuda"]:
        lines.append("no CUDA device visible to torch (a CPU build of torch, or CUDA_VISIBLE_DEVICES)")
    return "\n".join(lines)


# ------------------------------------------------------------------ kernels
def differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).reshape(a.shape[0], -1).any(dim=1).sum())


def linear_invariance(dtype: torch.dtype, dev: torch.device, rows: int, width: int) -> dict:
    """Each row alone vs inside batches of several sizes (at the tile position it has in the batch of
    `rows`, which in-order and `tl.dot` forms both keep); control: BLOCK_K halved."""
    from autobucket.engine.kernels.triton.linear import launch_linear
    from autobucket.engine.kernels.triton.tiles import LinearTiles, linear_tiles

    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, width, generator=g, device=dev).to(dtype)
    weight = torch.randn(2 * width, width, generator=g, device=dev).to(dtype)
    full = launch_linear(x, weight, None)
    differing = sum(differing_rows(launch_linear(x[:size], weight, None), full[:size]) for size in (1, 3, 17, rows // 2))
    tiles = linear_tiles(dtype)
    halved = launch_linear(x, weight, None, LinearTiles(tiles.block_m, tiles.block_n, tiles.block_k // 2, tiles.num_warps))
    torch_rows = sum(differing_rows(torch.nn.functional.linear(x[:size], weight), torch.nn.functional.linear(x, weight)[:size])
                     for size in (1, 3, 17, rows // 2))  # fmt: skip
    return {"differing": differing, "control_differing": differing_rows(halved, full), "torch_differing": torch_rows}


def attention_invariance(dtype: torch.dtype, dev: torch.device, length: int) -> dict:
    """One sequence's attention as one-shot prefill, chunked prefill over the cached prefix and decode
    over a right-aligned cache with noise before the sequence; control: the chunks and decode walk blocks
    of half the size."""
    from autobucket.engine.kernels.triton.attention import key_order, launch_attention
    from autobucket.engine.kernels.triton.tiles import ATTENTION_BLOCK_N

    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(1, h, length, 64, generator=g, device=dev).to(dtype) for h in (14, 2, 2))
    causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()

    def run(query, key, value, allowed, block):
        order, count = key_order(allowed)
        return launch_attention(query, key, value, order, count, 0.125, block)

    def forms(block):
        chunks = torch.cat([run(q[:, :, s : s + 32], k[:, :, : s + 32], v[:, :, : s + 32], causal[None, s : s + 32, : s + 32], block)
                            for s in range(0, length, 32)], dim=1)  # fmt: skip
        offset, columns = 11, length + 20
        caches = []
        for t in (k, v):
            cache = torch.randn(1, 2, columns, 64, generator=g, device=dev).to(dtype) * 50
            cache[:, :, offset : offset + length] = t
            caches.append(cache)
        allowed = torch.zeros(length, 1, columns, dtype=torch.bool, device=dev)
        allowed[:, 0, offset : offset + length] = causal
        decode = torch.cat([run(q[:, :, i : i + 1], caches[0], caches[1], allowed[i : i + 1], block) for i in range(length)], 1)
        return chunks, decode

    one_shot = run(q, k, v, causal[None], ATTENTION_BLOCK_N)
    chunks, decode = forms(ATTENTION_BLOCK_N)
    control_chunks, control_decode = forms(ATTENTION_BLOCK_N // 2)
    return {
        "differing": differing_rows(chunks[0], one_shot[0]) + differing_rows(decode[0], one_shot[0]),
        "control_differing": differing_rows(control_chunks[0], one_shot[0]) + differing_rows(control_decode[0], one_shot[0]),
    }


def shared_prefix_invariance(dtype: torch.dtype, dev: torch.device, prefix: int, rows: int) -> dict:
    """A decode step of `rows` rows on one shared prefix of `prefix` keys (the last row on none), each
    with its own keys after it, against the per-row attention over each row's whole sequence; control:
    the own keys' blocks restarted after the prefix."""
    from autobucket.engine.kernels.triton.attention import key_order, launch_attention
    from autobucket.engine.kernels.triton.shared_prefix_attention import launch_shared_prefix_attention

    g = torch.Generator(device=dev).manual_seed(5)
    own_columns = 3 * rows + 5
    query = torch.randn(rows, 14, 1, 64, generator=g, device=dev).to(dtype)
    own = [torch.randn(rows, 2, own_columns, 64, generator=g, device=dev).to(dtype) for _ in range(2)]
    shared = [torch.randn(1, 2, prefix, 64, generator=g, device=dev).to(dtype) for _ in range(2)]
    lengths = torch.arange(rows, device=dev) * 3 + 1  # own keys per row, right-aligned
    allowed = (torch.arange(own_columns, device=dev)[None, :] >= own_columns - lengths[:, None])[:, None]
    row_prefix = torch.zeros(rows, dtype=torch.int32, device=dev)
    row_prefix[-1] = -1
    shared_length = torch.tensor([prefix], dtype=torch.int32, device=dev)

    def shared_prefix(walk):
        order, count = key_order(allowed)
        return launch_shared_prefix_attention(query, *own, order, count, *shared, shared_length, row_prefix, 0, 0.125, walk=walk)

    full = [torch.cat([s.expand(rows, -1, -1, -1), o], dim=2) for s, o in zip(shared, own, strict=True)]
    full_allowed = torch.cat([(row_prefix >= 0)[:, None, None].expand(rows, 1, prefix), allowed], dim=2)
    per_row = launch_attention(query, *full, *key_order(full_allowed), 0.125)
    return {"differing": differing_rows(shared_prefix("sequence"), per_row),
            "control_differing": differing_rows(shared_prefix("split"), per_row)}  # fmt: skip


def row_invariance(dtype: torch.dtype, dev: torch.device, rows: int) -> dict:
    from autobucket.engine.kernels.triton.row_reductions import launch_logsumexp, rms_norm

    g = torch.Generator(device=dev).manual_seed(2)
    h = torch.randn(rows, 896, generator=g, device=dev).to(dtype)
    weight = torch.randn(896, generator=g, device=dev).to(dtype)
    logits = (torch.randn(rows, 5000, generator=g, device=dev) * 4).to(dtype)
    norm, lse = rms_norm(h, weight, 1e-6), launch_logsumexp(logits)
    return {
        "differing": differing_rows(rms_norm(h[:1], weight, 1e-6), norm[:1]) + differing_rows(launch_logsumexp(logits[:3])[:, None], lse[:3, None]),
        "control_differing": differing_rows(launch_logsumexp(logits, block=512)[:, None], lse[:, None]),
    }


def phase_kernels(rehearse: bool) -> dict:
    tf32_off()
    dev = device(rehearse)
    dtypes = [torch.float32] if rehearse else [torch.float32, torch.bfloat16]
    rows, width, length, prefix = (12, 32, 24, 37) if rehearse else (512, 896, 300, 300)
    results = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        results[f"linear/{name}"] = linear_invariance(dtype, dev, rows, width)
        results[f"attention/{name}"] = attention_invariance(dtype, dev, length)
        results[f"shared_prefix/{name}"] = shared_prefix_invariance(dtype, dev, prefix, 4 if rehearse else 64)
        results[f"rows/{name}"] = row_invariance(dtype, dev, rows)
    ok = all(r["differing"] == 0 and r["control_differing"] > 0 for r in results.values())
    return {"results": results, "ok": ok}


# ------------------------------------------------------------------ models and prompts
def model_for(rehearse: bool, out: Path, dtype: torch.dtype) -> torch.nn.Module:
    from autobucket.models import random_model_from_config

    config = json.loads(QWEN_CONFIG.read_text())
    if rehearse:
        config.update(TOY_GEOMETRY)
    path = out / "model-config" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return random_model_from_config(path.parent, dtype=dtype, device=device(rehearse))


def prompt_lengths(count: int, rehearse: bool) -> list[int]:
    """ShareGPT-like prompt lengths (log-normal, median ~90 tokens, clipped), fixed seed; toy in rehearsal."""
    g = torch.Generator().manual_seed(3)
    if rehearse:
        return [int(x) for x in torch.randint(3, 12, (count,), generator=g)]
    return [int(min(max(x, 8), 1024)) for x in torch.exp(torch.randn(count, generator=g) * 0.9 + 4.5)]


def prompts_for(lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------ mismatch
def phase_mismatch(rehearse: bool, out: Path) -> dict:
    from autobucket import Rollout, RolloutConfig, SamplingConfig, invariant, trainer_logprobs
    from autobucket.costs.coefficients import CostCoefficients
    from autobucket.engine.batching.prefill import positions_from_mask
    from autobucket.engine.trainer_logprobs import mismatch_metrics, teacher_forced_batch

    tf32_off()
    dtype = torch.float32 if rehearse else torch.bfloat16
    model = model_for(rehearse, out, dtype)
    prompts_n, n, new = (2, 2, 3) if rehearse else (8, 8, 64)
    prompts = prompts_for(prompt_lengths(prompts_n, rehearse), model.config.vocab_size)
    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0, n=n, seed=list(range(prompts_n)), logprobs=True, eos_token_id=[])
    results = {}
    for kernels in ("invariant", "torch"):
        config = RolloutConfig(kernels=kernels, persist_costs=False, costs=CostCoefficients() if rehearse else None)
        with forced(rehearse and kernels == "invariant"):
            result = Rollout(model, config=config).generate(prompts, sampling)
            flat_prompts = [p for p in prompts for _ in range(n)]
            completions = [t for group in result.tokens for t in group]
            sampled = [lp for group in result.logprobs for lp in group]
            ids, mask, width = teacher_forced_batch(flat_prompts, completions)
            ids, mask = ids.to(model.device), mask.to(model.device)
            import contextlib

            with torch.no_grad(), invariant(model) if kernels == "invariant" else contextlib.nullcontext():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        trainer = trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:], 1.0).float().cpu()
        sampler = torch.zeros_like(trainer)
        valid = torch.zeros_like(trainer, dtype=torch.bool)
        for row, lp in enumerate(sampled):
            sampler[row, : len(lp)] = torch.tensor(lp)
            valid[row, : len(lp)] = True
        metrics = mismatch_metrics(trainer, sampler, valid)
        results[kernels] = {"k3": metrics["mismatch/k3"], "max_abs_logp_diff": metrics["mismatch/max_abs_logp_diff"],
                            "tokens": int(valid.sum()), "route": result.route}  # fmt: skip
    ok = results["invariant"]["max_abs_logp_diff"] == 0.0 and results["invariant"]["k3"] == 0.0
    return {"results": results, "ok": ok, "dtype": str(dtype)}


# ------------------------------------------------------------------ speed
def phase_speed(rehearse: bool, out: Path) -> dict:
    from autobucket import Rollout, RolloutConfig, SamplingConfig
    from autobucket.costs.coefficients import CostCoefficients

    tf32_off()
    dtype = torch.float32 if rehearse else torch.bfloat16
    model = model_for(rehearse, out, dtype)
    prompts_n, n, new, repeats = (2, 2, 3, 1) if rehearse else (32, 8, 256, 2)
    prompts = prompts_for(prompt_lengths(prompts_n, rehearse), model.config.vocab_size)
    dev = device(rehearse)

    def hf_generate():
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in prompts], batch_first=True).flip(1)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True).flip(1)
        model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True, max_new_tokens=new,
                       min_new_tokens=new, num_return_sequences=n, pad_token_id=0)  # fmt: skip

    def generate_batch():
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=new, do_sample=True, num_return_sequences=n, pad_token_id=0, eos_token_id=-1)
        model.generate_batch([p for p in prompts for _ in range(1)], generation_config=config)

    def auto(kernels, graphs):
        # the rehearsal plans with fixed coefficients: an online timing probe is a rollout, slow under the interpreter
        config = RolloutConfig(kernels=kernels, persist_costs=False, costs=CostCoefficients() if rehearse else None,
                               cuda_graphs=graphs)  # fmt: skip
        sampling = SamplingConfig(max_new_tokens=new, n=n, temperature=1.0, eos_token_id=[])
        rollout = Rollout(model, config=config)

        def run():
            with forced(rehearse and kernels == "invariant"), graphs_forced(rehearse and graphs):
                decode_step = rollout.generate(prompts, sampling).profile.plan["decode_step"]
            if decode_step != ("captured" if graphs else "engine"):
                raise RuntimeError(f"decoded in the {decode_step!r} form")

        return run

    # "default" is the model's own ops, which kernels="auto" takes on a GPU (kernels="torch": the same on the CPU)
    contenders = {"hf_generate": hf_generate, "generate_batch": generate_batch,
                  "auto_default_eager": auto("torch", False), "auto_default_graphs": auto("torch", True),
                  "auto_invariant_eager": auto("invariant", False), "auto_invariant_graphs": auto("invariant", True)}  # fmt: skip
    if rehearse:  # its CPU defaults reserve ~10 GB and take seconds a call: checked on the GPU only
        del contenders["generate_batch"]
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    errors: dict[str, str] = {}
    for _ in range(repeats + 1):  # the first round warms up (and captures the graphs)
        for name, run in contenders.items():
            if name in errors:
                continue
            try:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    run()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                samples[name].append(time.perf_counter() - start)
            except Exception as error:  # a contender that cannot run here is reported, not fatal
                errors[name] = f"{type(error).__name__}: {error}"[:300]
        result = speed_result(samples, errors)
        (out / "speed.json").write_text(json.dumps(result, indent=1))  # a round kept if the time box ends the next
    return result


def speed_result(samples: dict[str, list[float]], errors: dict[str, str]) -> dict:
    medians = {name: statistics.median(s[1:] or s) for name, s in samples.items() if s}
    ratios = {}
    for kernels in ("default", "invariant"):
        eager, graphs = medians.get(f"auto_{kernels}_eager"), medians.get(f"auto_{kernels}_graphs")
        if eager and graphs:
            ratios[f"{kernels}: graphs / eager"] = graphs / eager
    if "hf_generate" in medians and "auto_default_graphs" in medians:
        ratios["HF generate / auto default graphs"] = medians["hf_generate"] / medians["auto_default_graphs"]
    if medians.get("auto_default_graphs") and "auto_invariant_graphs" in medians:
        ratios["invariant / default, graphs"] = medians["auto_invariant_graphs"] / medians["auto_default_graphs"]
    wanted = ("auto_default_eager", "auto_default_graphs", "auto_invariant_eager", "auto_invariant_graphs")
    return {"samples_s": samples, "median_s": medians, "ratios": ratios, "errors": errors,
            "ok": all(name in medians for name in wanted)}  # fmt: skip


# ------------------------------------------------------------------ the decode step alone
def phase_step(rehearse: bool, out: Path) -> dict:
    """The decode step of `rows` rows over a `context`-token cache, eager and replayed from its graph, each
    step timed alone (synchronised), the two interleaved; per kernel set. The logits of the two forms are
    compared at every step (bitwise on the invariant kernels; up to rounding on the model's own ops)."""
    tf32_off()
    dtype = torch.float32 if rehearse else torch.bfloat16
    model = model_for(rehearse, out, dtype)
    rows, context, steps = (4, 24, 2) if rehearse else (64, 1024, 20)
    prompts = prompts_for([context] * rows, model.config.vocab_size)
    results: dict[str, dict] = {}
    for kernels in ("torch", "invariant"):
        results[kernels] = step_times(model, prompts, kernels, steps, rehearse)
        (out / "step.json").write_text(json.dumps({"results": results, "ok": False}, indent=1))
    ok = all(r["graph_ms"] and r["logits_equal"] for r in results.values() if r["kernels"] == "invariant")
    return {"rows": rows, "context": context, "results": results, "ok": ok}


def step_times(model, prompts, kernels: str, steps: int, rehearse: bool) -> dict:
    import contextlib

    from autobucket import RolloutConfig
    from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
    from autobucket.engine.model_access.hf_compat import forward_spec
    from autobucket.engine.plan.forward_plan import choose_plan, plan_entered

    dev = next(model.parameters()).device
    runners = {}
    for graphs in (False, True):
        config = RolloutConfig(kernels=kernels, cuda_graphs=graphs, persist_costs=False)
        with contextlib.ExitStack() as scope:
            scope.enter_context(forced(rehearse and kernels == "invariant"))
            scope.enter_context(graphs_forced(rehearse and graphs))
            scope.enter_context(torch.inference_mode())
            plan = choose_plan(model, config, None, "bucketed")
            scope.enter_context(plan_entered(plan, model, None))
            shape = CacheShape(len(prompts), len(prompts[0]) + steps + 2)
            runner = ModelRunner(model, forward_spec(model), shape, 0, model.config.vocab_size, track_seen=False)
            for start in range(0, len(prompts), 8):  # prefill 8 rows at a time: the logits stay small
                group = prompts[start : start + 8]
                output, _ = runner.prefill(group)
                first = output.last_logits.argmax(-1)
                runner.insert(output, RowInsert(list(range(len(group))), first, [len(p) for p in group], None))
        runners[graphs] = (runner, plan)
    times: dict[bool, list[float]] = {False: [], True: []}
    equal, largest = True, 0.0
    for step in range(steps + 1):  # step 0 captures the graph: not timed
        logits = {}
        for graphs, (runner, plan) in runners.items():
            with contextlib.ExitStack() as scope:
                scope.enter_context(forced(rehearse and kernels == "invariant"))
                scope.enter_context(graphs_forced(rehearse and graphs))
                scope.enter_context(torch.inference_mode())
                scope.enter_context(plan_entered(plan, model, None))
                synchronize(dev)
                started = time.perf_counter()
                runner.prepare_decode()
                logits[graphs] = runner.decode_logits().clone()
                synchronize(dev)
                if step:
                    times[graphs].append((time.perf_counter() - started) * 1e3)
        equal = equal and torch.equal(logits[False], logits[True])
        largest = max(largest, (logits[False] - logits[True]).abs().max().item())
        tokens = logits[False].argmax(-1)
        for runner, _ in runners.values():
            runner.advance(tokens)
    eager_ms, graph_ms = statistics.median(times[False]), statistics.median(times[True])
    return {"kernels": kernels, "forms": [runners[False][0].decode_step, runners[True][0].decode_step],
            "eager_ms": eager_ms, "graph_ms": graph_ms, "graph_over_eager": graph_ms / eager_ms,
            "logits_equal": equal, "max_abs_logit_diff": largest,
            "captures": runners[True][0].captured.stats.graphs if runners[True][0].captured else 0}  # fmt: skip


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ table
def table(out: Path) -> int:
    summary = {}
    for phase in ("env", "kernels", "mismatch", "speed", "step"):
        path = out / f"{phase}.json"
        summary[phase] = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result (timed out or failed)"}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{'phase':<10} {'ok':<6} detail")
    env = summary["env"]
    print(f"{'env':<10} {env.get('ok')!s:<6} python {env.get('python')} torch {env.get('torch')} triton {env.get('triton')} "
          f"transformers {env.get('transformers')} {env.get('gpu', 'cpu')}")  # fmt: skip
    for problem in env.get("floor_problems", []):
        print(f"{'env':<10} {'False':<6} {problem}")
    for name, r in summary["kernels"].get("results", {}).items():
        print(f"{'kernels':<10} {summary['kernels']['ok']!s:<6} {name}: differing {r['differing']}, control {r['control_differing']}")
    for name, r in summary["mismatch"].get("results", {}).items():
        print(f"{'mismatch':<10} {summary['mismatch']['ok']!s:<6} {name}: k3 {r['k3']:.3g}, max |dlogp| {r['max_abs_logp_diff']:.3g}, {r['tokens']} tokens")
    for name, seconds in summary["speed"].get("median_s", {}).items():
        print(f"{'speed':<10} {summary['speed']['ok']!s:<6} {name}: {seconds:.3f} s")
    for name, ratio in summary["speed"].get("ratios", {}).items():
        print(f"{'speed':<10} {summary['speed']['ok']!s:<6} {name}: {ratio:.3f}")
    for name, error in summary["speed"].get("errors", {}).items():
        print(f"{'speed':<10} {'-':<6} {name}: {error}")
    for name, r in summary["step"].get("results", {}).items():
        print(f"{'step':<10} {summary['step']['ok']!s:<6} kernels={name} ({r['forms'][0]} vs {r['forms'][1]}): "
              f"eager {r['eager_ms']:.2f} ms, graph {r['graph_ms']:.2f} ms ({r['graph_over_eager']:.3f}x), "
              f"logits equal {r['logits_equal']} (max |d| {r['max_abs_logit_diff']:.3g})")  # fmt: skip
    for phase, result in summary.items():
        if "error" in result:
            print(f"{phase:<10} {'False':<6} {result['error']}")
    return 0 if all(summary[p].get("ok") for p in ("env", "kernels", "mismatch")) else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["env", "kernels", "mismatch", "speed", "step", "table"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "table":
        return table(args.out)
    if args.rehearse:
        torch.set_num_threads(1)
    started = time.perf_counter()
    runs = {"env": lambda: phase_env(args.rehearse), "kernels": lambda: phase_kernels(args.rehearse),
            "mismatch": lambda: phase_mismatch(args.rehearse, args.out), "speed": lambda: phase_speed(args.rehearse, args.out),
            "step": lambda: phase_step(args.rehearse, args.out)}  # fmt: skip
    result = runs[args.phase]()
    result["phase_s"] = time.perf_counter() - started
    if args.phase == "env":
        print(describe_env(result))
    (args.out / f"{args.phase}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({args.phase: {k: v for k, v in result.items() if k != "samples_s"}}, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
