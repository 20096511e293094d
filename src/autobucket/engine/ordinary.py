"""The ordinary route: HF `generate` on left-padded batches of at most `continuous_batch_size` rows.

Outputs are cut at each row's first EOS (inclusive), or at the token that completed a stop string: what
HF writes after it is structural padding.
A logits processor times the first forward of each `generate` call as prefill and each later step
as decode, so the profile has the same breakdown as the CB routes; nothing is registered on the model."""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from autobucket.costs.coefficients import ORDINARY_STEP, PREFILL_FORWARD
from autobucket.engine.batching.batcher import admission_order
from autobucket.engine.batching.prefill import left_pad
from autobucket.engine.finished import StopStrings, cut_finished
from autobucket.engine.generation_setup import ResolvedSampling
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.request import Request, call_requests
from autobucket.engine.selection import Selection, seen_in_left_padded
from autobucket.profile import PhaseTimer, Profile, Timing


class _StepClock:
    """A logits processor that times the steps of one `generate` call: called right after each forward,
    the first call ends the prefill forward and each later call ends one decode *step* (forward plus HF's
    per-step work between forwards: processors, stopping checks, growing `input_ids`), as a CB step counts.

    Timing from inside the call (not with forward hooks on the model) keeps the trainer's model untouched
    and never times another thread's forwards of the same model."""

    def __init__(self, profile: Profile, timer: PhaseTimer, rows: int, width: int) -> None:
        self.profile, self.timer, self.rows, self.width = profile, timer, rows, width
        self.calls, self.started = 0, time.perf_counter()
        self.last = self.started

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.timer.sync()
        now = time.perf_counter()
        elapsed_ms = (now - self.last) * 1e3
        if self.calls == 0:
            self.profile.prefill_ms += elapsed_ms
            self.profile.prefill_forwards += 1
            self.profile.timings.append(Timing(PREFILL_FORWARD, self.rows, self.width, elapsed_ms))
        else:  # decode step k = self.calls attends the prompt width plus k positions
            self.profile.decode_ms += elapsed_ms
            self.profile.decode_forwards += 1
            self.profile.timings.append(Timing(ORDINARY_STEP, self.rows, self.width + self.calls, elapsed_ms))
        self.calls, self.last = self.calls + 1, now
        return scores


class _EngineSelection:
    """A logits processor that makes HF `generate` pick exactly the engine's token.

    It applies the engine's `Selection` (padding-aware repetition penalty, greedy or stream
    sampling) to each step's scores and returns scores that are -inf everywhere but the chosen
    token, so HF's greedy step takes it. Rows are (prompt, sample) requests, so sampled tokens
    follow the same per-request streams as on the CB routes.
    """

    def __init__(self, selection: Selection, requests: Sequence[Request], width: int, pad_lengths: Sequence[int]):
        self.selection, self.width = selection, width
        self.prompts, self.samples = [r.prompt for r in requests], [r.sample for r in requests]
        self.pad_lengths = torch.as_tensor(list(pad_lengths), dtype=torch.long)
        self.logprobs: list[torch.Tensor] = []  # per step [rows]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        seen = None
        if self.selection.uses_penalty:
            seen = seen_in_left_padded(input_ids, self.pad_lengths.to(input_ids.device), scores.shape[-1])
        histories = []
        if self.selection.needs_histories:  # each row's own ids, without its left padding
            histories = [row_ids[pad:] for row_ids, pad in zip(input_ids, self.pad_lengths.tolist(), strict=True)]
        tokens, logprobs = self.selection.choose(
            scores.float(), seen, self.prompts, self.samples, [step] * len(self.prompts), histories
        )
        if logprobs is not None:
            self.logprobs.append(logprobs)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens[:, None], 0.0)


class _RowStopStrings(StoppingCriteria):
    """HF stopping criteria that end each row at its first completed stop string, matched over the row's own
    prompt and generated ids (HF's own criteria would read the batch's left padding as part of the text),
    remembering how many tokens each row had generated when it stopped."""

    def __init__(self, stops: StopStrings, prompts: Sequence[Sequence[int]], width: int) -> None:
        self.stops, self.prompts, self.width = stops, prompts, width
        self.stop_lengths: list[int | None] = [None] * len(prompts)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        steps = input_ids.shape[1] - self.width  # tokens generated so far
        # [rows, <= window]: the newest generated ids, all that a match reads besides the prompt's end
        recent = input_ids[:, self.width + max(0, steps - self.stops.window) :].tolist()
        requests = list(zip(self.prompts, recent, strict=True))
        for row, (done, stopped) in enumerate(zip(self.stops.completed(requests), self.stop_lengths, strict=True)):
            if done and stopped is None:
                self.stop_lengths[row] = steps
        return torch.tensor([length is not None for length in self.stop_lengths], device=input_ids.device)


class _RowBudgets(StoppingCriteria):
    """HF stopping criteria that end each row at its own new-token budget (HF's `max_new_tokens` is one for
    the batch: the batch's largest), so a batch stops once every row is done."""

    def __init__(self, budgets: Sequence[int], width: int) -> None:
        self.budgets, self.width = list(budgets), width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        steps = input_ids.shape[1] - self.width  # tokens generated so far
        return torch.tensor([steps >= budget for budget in self.budgets], device=input_ids.device)


@without_autograd
def run_ordinary(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: ResolvedSampling,
    profile: Profile,
    timer: PhaseTimer,
    stops: StopStrings | None = None,
) -> dict[tuple[int, int], Request]:
    """Batches of at most `continuous_batch_size` (prompt, sample) rows; each row is prefilled (no sharing)
    and generates up to its prompt's budget (`sampling.budgets`). Rows are batched largest budget first,
    as the CB routes queue them, so a batch's rows need similar numbers of steps."""
    order = admission_order(sampling.budgets)
    requests = call_requests(prompts, order, sampling.budgets, sampling.n, sampling.selection.want_logprobs)
    for start in range(0, len(requests), sampling.continuous_batch_size):
        batch = requests[start : start + sampling.continuous_batch_size]
        _generate_batch(model, batch, sampling, profile, timer, stops)
        profile.max_active_rows = max(profile.max_active_rows, len(batch))
    return {request.key: request for request in requests}


def _generate_batch(model, requests: list[Request], sampling: ResolvedSampling, profile, timer, stops: StopStrings | None):
    """Generate for `requests` in one HF `generate` call; each request's tokens, logprobs and finish reason
    are written into its record."""
    device = next(model.parameters()).device
    batch = [r.prompt_ids for r in requests]
    input_ids, attention_mask = left_pad(batch, sampling.pad_token_id, device)
    width = input_ids.shape[1]
    config = copy.deepcopy(sampling.generation_config)
    config.repetition_penalty = 1.0  # applied by _EngineSelection, over real tokens only
    row_budgets = [r.budget for r in requests]
    config.max_new_tokens = max(row_budgets)
    selection = sampling.selection
    # else HF's own greedy step picks the engine's token
    needs_selector = selection.needs_steps or selection.want_logprobs or selection.uses_penalty
    selector = _EngineSelection(selection, requests, width, [width - len(p) for p in batch]) if needs_selector else None
    profile.prefill_tokens += len(batch) * width
    # transformers 4.57 replaces values equal to GenerationConfig defaults (do_sample=False,
    # repetition_penalty=1.0) with the model's own unless told not to; 5.x has no such merge.
    exact = {"use_model_defaults": False} if "use_model_defaults" in inspect.signature(model.generate).parameters else {}
    clock = _StepClock(profile, timer, len(batch), width)
    row_stops = _RowStopStrings(stops, batch, width) if stops is not None else None
    criteria = [row_stops] if row_stops is not None else []
    if min(row_budgets) < config.max_new_tokens:
        criteria.append(_RowBudgets(row_budgets, width))
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        logits_processor=LogitsProcessorList([clock, selector] if selector else [clock]),
        stopping_criteria=StoppingCriteriaList(criteria),
        # HF turns on its lockstep for an FSDP or ZeRO-3 model at world size > 1 (an all-reduce per step):
        # off, since gathered weights need none and the engine's lockstep pairs every forward of every
        # route itself (`model_access/lockstep.py`), where HF's all-reduce would be one more unpaired
        synced_gpus=False,
        **exact,
    )
    eos = frozenset(sampling.eos_token_ids)
    step_logprobs = torch.stack(selector.logprobs, dim=1).tolist() if selector and selector.logprobs else None
    stop_lengths = row_stops.stop_lengths if row_stops is not None else [None] * len(batch)
    for row, (request, generated) in enumerate(zip(requests, output[:, width:].tolist(), strict=True)):
        request.tokens, request.finish_reason = cut_finished(generated, eos, request.budget, stop_lengths[row])
        if step_logprobs is not None:
            request.logprobs = step_logprobs[row][: len(request.tokens)]
