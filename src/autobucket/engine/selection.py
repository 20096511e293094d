"""Token selection for every route: per-sequence logits processors and the repetition penalty, then greedy
or route-invariant sampling.

Greedy takes each row's first argmax (`sampling/argmax.py`). Sampling warps the logits with HF's warpers
in HF's order (`sampling/warpers.py`) and draws by inverse CDF (`sampling/inverse_cdf.py`) with one
uniform per (request seed, sample, step) from a counter-based stream (`sampling/streams.py`), so a
request's tokens do not depend on its batch, route or refill order.

The repetition penalty follows HF's `RepetitionPenaltyLogitsProcessor` exactly (negative logits
multiplied, positive divided, in fp32), but over a `seen` mask `[rows, vocab]` of the prompt's and
generated tokens, never of padding: a row's history does not depend on who it was batched with. The
generation options HF applies through logits processors, `prefix_allowed_tokens_fn` and a caller's own
processors run on each row's own ids (`sampling/row_processors.py`), in HF's order around the penalty."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autobucket.engine.kernels.trainer_reductions import log_softmax_at_widened
from autobucket.engine.sampling.argmax import first_argmax
from autobucket.engine.sampling.inverse_cdf import UnsamplableRows, sample_inverse_cdf
from autobucket.engine.sampling.row_processors import RowProcessors
from autobucket.engine.sampling.streams import stream_uniforms
from autobucket.engine.sampling.warpers import warp_logits
from autobucket.engine.trainer_logprobs import trainer_logprobs


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float  # 0: greedy
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    request_seeds: tuple[int, ...]  # per prompt: the key of its random streams
    min_p: float = 0.0  # 0.0: off
    typical_p: float = 1.0  # 1.0: off
    epsilon_cutoff: float = 0.0  # 0.0: off
    eta_cutoff: float = 0.0  # 0.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32 logits -> the warped scores sampled from (every route calls this)."""
        return warp_logits(
            logits, self.temperature, self.top_k, self.top_p, min_p=self.min_p, typical_p=self.typical_p,
            epsilon_cutoff=self.epsilon_cutoff, eta_cutoff=self.eta_cutoff,
        )



def select_tokens(
    logits: torch.Tensor,
    settings: SamplerSettings,
    prompts: Sequence[int],
    samples: Sequence[int],
    steps: Sequence[int],
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, vocab] fp32 logits (penalty already applied) -> tokens [rows], logprobs [rows] or None.

    Greedy logprobs are the log-softmax of the (penalised) logits at the argmax; sampled logprobs are
    under the warped distribution actually sampled from, as RL importance ratios need.
    """
    if settings.greedy:
        tokens = first_argmax(logits)
        if not want_logprobs:
            return tokens, None
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    seeds = [settings.request_seeds[p] for p in prompts]
    uniforms = torch.from_numpy(stream_uniforms(seeds, samples, steps)).to(logits.device)
    try:
        tokens, logprobs = sample_inverse_cdf(settings.warp(logits), uniforms)
    except UnsamplableRows as error:  # named for the caller: which prompt, sample and new token
        where = [f"prompt {prompts[row]} (sample {samples[row]}, new token {steps[row]})" for row in error.rows]
        raise UnsamplableRows(error.rows, where) from error
    return tokens, (logprobs if want_logprobs else None)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [rows, vocab] fp32, seen [rows, vocab] bool -> penalised logits [rows, vocab]."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def seen_tokens(prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool: which token ids occur in each prompt."""
    seen = torch.zeros((len(prompts), vocab_size), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        seen[row, torch.as_tensor(prompt, dtype=torch.long)] = True
    return seen.to(device)


def seen_in_left_padded(input_ids: torch.Tensor, pad_lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: ids occurring in each row's real tokens of a left-padded `[rows, width]` batch."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    rows, columns = torch.nonzero(positions[None, :] >= pad_lengths[:, None], as_tuple=True)
    seen = torch.zeros((input_ids.shape[0], vocab_size), dtype=torch.bool, device=input_ids.device)
    seen[rows, input_ids[rows, columns]] = True
    return seen


@dataclass(frozen=True)
class Selection:
    """How every route turns one step's logits into tokens for one call."""

    sampler: SamplerSettings
    repetition_penalty: float
    want_logprobs: bool
    logprobs_mode: str = "trainer"  # SamplingConfig.logprobs_mode
    logits_dtype: torch.dtype = torch.float32  # the model's dtype: trainer logprobs are computed in it
    eos_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0  # EOS suppressed for rows with fewer new tokens (HF's MinNewTokensLength)
    row_processors: RowProcessors | None = None  # per-sequence logits processors (`sampling/row_processors.py`)

    @property
    def suppresses_early_eos(self) -> bool:
        return self.min_new_tokens > 0 and bool(self.eos_token_ids)

    @property
    def needs_steps(self) -> bool:
        """Whether `choose` reads each row's (prompt, sample, step): sampling's stream keys, the EOS
        suppression, or per-sequence processors."""
        return not self.sampler.greedy or self.suppresses_early_eos or self.row_processors is not None

    @property
    def needs_histories(self) -> bool:
        """Whether `choose` reads each row's token history (prompt and generated ids)."""
        return self.row_processors is not None and self.row_processors.reads_histories

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    def choose(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor | None,
        prompts: Sequence[int],
        samples: Sequence[int],
        steps: Sequence[int],
        histories: Sequence[Sequence[int] | torch.Tensor] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [rows, vocab] fp32, seen [rows, vocab] bool | None -> (tokens [rows], logprobs [rows] | None).
        `histories`: each row's prompt and generated ids where `needs_histories`."""
        raw = logits
        processors = self.row_processors
        if processors is not None:
            logits = processors.apply_first(logits, histories, prompts)
        if seen is not None and self.uses_penalty:
            logits = apply_repetition_penalty(logits, seen, self.repetition_penalty)
        if self.suppresses_early_eos:
            logits = self._without_early_eos(logits, steps, in_place=logits is not raw)
        if processors is not None:
            logits = processors.apply_rest(logits, histories, prompts, steps, in_place=logits is not raw)
        processed = self.want_logprobs and self.logprobs_mode == "processed"
        tokens, logprobs = select_tokens(logits, self.sampler, prompts, samples, steps, processed)
        if self.want_logprobs and not processed:
            # The model's own logits (fp32 copies of its dtype's values, so the cast back is exact).
            temperature = 1.0 if self.sampler.greedy else self.sampler.temperature
            if self.logits_dtype == torch.bfloat16 and temperature == 1.0:  # read as they are held, no bf16 copy
                logprobs = log_softmax_at_widened(raw, tokens).float()
            else:
                logprobs = trainer_logprobs(raw.to(self.logits_dtype), tokens, temperature, kernel=True).float()
        return tokens, logprobs

    def _without_early_eos(self, logits: torch.Tensor, steps: Sequence[int], in_place: bool = False) -> torch.Tensor:
        """logits [rows, vocab] with -inf at the EOS ids of rows that have fewer than `min_new_tokens` new
        tokens (`steps`: each row's count), as HF's MinNewTokensLengthLogitsProcessor; written into a copy
        unless `in_place` (the raw logits are what trainer-mode logprobs are read from; the penalty's
        output is already a copy)."""
        early = [row for row, step in enumerate(steps) if step < self.min_new_tokens]
        if not early:
            return logits
        rows = torch.tensor(early, dtype=torch.long, device=logits.device)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=logits.device)
        masked = logits if in_place else logits.clone()
        masked[rows[:, None], eos[None, :]] = float("-inf")
        return masked
