"""Continuous batching, host side: the queue, the active rows, retained prefills and finish checks.

One loop serves every CB route; routes differ only in their admission policy, which splits each
admission's prompts into prefill groups (equal_width: one padded group; aligned: one group per
prompt; bucketed: the planner's padded, packed or chunked groups). All device work goes through a `ModelRunner`.

Work items are (prompt, sample) pairs, queued prompt-major. A prompt is prefilled once; its K/V and
last-token logits serve all of its `n` samples: each sample draws its own first token from the
shared logits, and the K/V is copied into one cache row per sample. When an admission ends in the
middle of a prompt's samples, that prompt's prefill is kept (`self.retained`) for the next
admission, so a prompt is never prefilled twice.

The only host sync per decode step is reading the new tokens back (`tolist`); EOS, stop-string and
budget checks happen on those host integers."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autobucket.engine.batching.model_runner import ModelRunner, RowInsert
from autobucket.engine.batching.prefill import PrefillGroup, PrefillOutput, as_group
from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.batching.prefix_reuse import PrefixAdmission, PrefixReuse
from autobucket.engine.batching.static_cache import fill_holes_order
from autobucket.engine.finished import Finished, StopStrings
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.selection import Selection
from autobucket.planning.costs import CB_STEP, KV_COPY, PREFILL_FORWARD
from autobucket.planning.forms import PADDED
from autobucket.profile import PhaseTimer, Profile

# A route's admission policy: the admission's prompt indices -> prefill groups (a plain list of prompt
# indices is a padded group).
AdmissionPolicy = Callable[[Sequence[int]], list[list[int]] | list[PrefillGroup]]

CONTINUED = "continued"  # a group whose prompts continue given K/V (from the prefix cache or a shared prefix)


@dataclass
class _Row:
    """Host-side state of one active cache row: one sample of one prompt."""

    prompt: int
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None


@dataclass
class _Source:
    """Where an admitted prompt's prefill lives: row `row` of `output`."""

    output: PrefillOutput
    row: int
    seen: torch.Tensor | None  # [vocab] bool prompt tokens (with a repetition penalty)


def admission_order(budgets: Sequence[int]) -> list[int]:
    """Prompt indices in the order they queue: largest budget first (stable: equal budgets keep the input
    order). With more requests than rows, a long request admitted last would decode alone at the end;
    longest first, refills fill the rows the short ones free (list scheduling: 64 budgets of 16-128 on 32
    rows take 153 decode steps on average instead of 213). Results are keyed by request, so the order
    changes no output."""
    return sorted(range(len(budgets)), key=lambda prompt: -budgets[prompt])


class ContinuousBatcher:
    """Runs one `generate` call's CB schedule. Create one per call."""

    def __init__(
        self,
        runner: ModelRunner,
        selection: Selection,
        eos_token_ids: Sequence[int],
        budgets: Sequence[int],
        profile: Profile,
        timer: PhaseTimer,
        prefix: PrefixReuse | None = None,
        stops: StopStrings | None = None,
    ) -> None:
        self.runner, self.selection, self.profile, self.timer = runner, selection, profile, timer
        self.stops = stops
        # None: every prompt prefilled whole, nothing remembered
        self.prefix = PrefixAdmission(prefix, runner, profile, timer) if prefix is not None else None
        self.prompts: Sequence[Sequence[int]] = ()
        self.eos, self.budgets = frozenset(eos_token_ids), budgets  # budgets: per prompt index
        self.rows: list[_Row] = []
        self.retained: tuple[int, _Source] | None = None  # a prompt with samples still queued
        self.finished: dict[tuple[int, int], Finished] = {}

    @without_autograd
    def run(
        self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, admission_policy: AdmissionPolicy
    ) -> dict[tuple[int, int], Finished]:
        """Finished results keyed by (prompt index, sample index)."""
        self.prompts = prompts
        queue = deque((p, s) for p in admission_order(self.budgets) for s in range(samples_per_prompt))
        rows_limit = self.runner.cache_shape.continuous_batch_size
        while queue or self.rows:
            free_rows = rows_limit - len(self.rows)
            if queue and free_rows:
                admitted = [queue.popleft() for _ in range(min(free_rows, len(queue)))]
                still_queued = queue[0][0] if queue else None
                self._admit(prompts, admitted, still_queued, admission_policy)
            if self.rows:
                self._decode_step()
        return self.finished

    # ------------------------------------------------------------ admission
    def _admit(self, prompts, admitted: list[tuple[int, int]], still_queued: int | None, policy) -> None:
        sources: dict[int, _Source] = {}
        if self.retained is not None:
            sources[self.retained[0]] = self.retained[1]
        new_prompts = list(dict.fromkeys(p for p, _ in admitted if p not in sources))
        hits = self.prefix.hits(prompts, new_prompts) if self.prefix is not None else {}
        whole = [p for p in new_prompts if p not in hits]
        groups = [as_group(b) for b in policy(whole)] if whole else []
        continued = self.prefix.continued_groups(prompts, hits) if self.prefix is not None else []
        self.profile.prefill_groups.append([list(g.prompts) for g in groups] + continued)
        self.profile.prefill_forms.append([g.form for g in groups] + [CONTINUED] * len(continued))
        # Widest group first: it sets the front, narrower groups then fit without a gap.
        work = [(g.prompts, lambda g=g: self._prefill(g, [prompts[i] for i in g.prompts])) for g in groups]
        work += [(tuple(c), lambda c=c: self._prefill_continued(c, hits)) for c in continued]
        for _, run in sorted(work, key=lambda item: -max(len(prompts[i]) for i in item[0])):
            sources.update(run())
        by_output: dict[int, list[tuple[int, int]]] = {}
        for item in admitted:
            by_output.setdefault(id(sources[item[0]].output), []).append(item)
        for items in by_output.values():
            # In the output's row order (stable: a prompt's samples keep theirs), so a group whose rows are
            # all admitted is copied into the cache as one block instead of being gathered into a copy first
            # (continued groups came back in another order than the queue's: a whole extra K/V copy each).
            items.sort(key=lambda item: sources[item[0]].row)
            self._start_samples(prompts, items, sources)
        self.retained = (still_queued, sources[still_queued]) if still_queued in sources else None

    def _prefill(self, group: PrefillGroup, group_prompts: list[Sequence[int]]) -> dict[int, _Source]:
        with self.timer.phase("prefill_ms"):
            started = time.perf_counter()
            output, seen = self.runner.prefill(group_prompts, group.form, group.chunk_tokens)
            self.timer.sync()
            if group.form == PADDED:  # the timing model is of padded forwards; packed/chunked are not fed to it
                self.profile.record(PREFILL_FORWARD, len(group.prompts), max(map(len, group_prompts)), started)
        self.profile.prefill_forwards += output.forwards
        self.profile.prefill_tokens += output.tokens
        return {p: _Source(output, b, None if seen is None else seen[b]) for b, p in enumerate(group.prompts)}

    def _prefill_continued(self, group: list[int], hits: dict[int, PrefixHit]) -> dict[int, _Source]:
        output, seen = self.prefix.prefill_continued(group, hits, self.prompts)
        return {p: _Source(output, b, None if seen is None else seen[b]) for b, p in enumerate(group)}

    def _start_samples(self, prompts, items: list[tuple[int, int]], sources: dict[int, _Source]) -> None:
        """First tokens of `items` (all prefilled in one output) from the shared prefill logits."""
        output = sources[items[0][0]].output
        source_rows = [sources[p].row for p, _ in items]
        seen = torch.stack([sources[p].seen for p, _ in items]) if self.runner.seen is not None else None
        with self.timer.phase("prefill_ms"):
            index = torch.tensor(source_rows, dtype=torch.long, device=self.runner.device)
            histories = [prompts[p] for p, _ in items] if self.selection.needs_histories else ()
            tokens, logprobs = self.selection.choose(
                output.last_logits[index], seen, [p for p, _ in items], [s for _, s in items], [0] * len(items),
                histories,
            )
        tokens_host = tokens.tolist()
        logprobs_host = logprobs.tolist() if logprobs is not None else [None] * len(items)
        rows = [
            _Row(p, s, [token], None if logprob is None else [logprob])
            for (p, s), token, logprob in zip(items, tokens_host, logprobs_host, strict=True)
        ]
        keep = []
        for b, (row, stopped) in enumerate(zip(rows, self._completes_stop_string(rows), strict=True)):
            if not self._finish_if_done(row, stopped):
                keep.append((b, row))
            elif self.prefix is not None:  # its K/V is the prompt's own
                prompt, length = prompts[row.prompt], len(prompts[row.prompt])
                self.prefix.remember(prompt, lambda start, b=b, n=length: output.prompt_key_values(source_rows[b], n, start))
        if keep:
            with self.timer.phase("cache_ms"):
                self._insert(prompts, output, source_rows, tokens, seen, keep)

    def _insert(self, prompts, output: PrefillOutput, source_rows: list[int], tokens, seen, keep) -> None:
        index = torch.tensor([b for b, _ in keep], dtype=torch.long, device=self.runner.device)
        first, seen = tokens[index], (seen[index] if seen is not None else None)
        if seen is not None:
            seen[torch.arange(len(keep), device=self.runner.device), first] = True
        lengths = [len(prompts[row.prompt]) for _, row in keep]
        # The first insert also allocates the cache (a per-call cost): only later copies are KV-copy timings.
        allocates, started = self.runner.store is None, time.perf_counter()
        self.profile.shared_kv_rows += self.runner.insert(output, RowInsert([source_rows[b] for b, _ in keep], first, lengths, seen))
        if not allocates and output.segments is None:  # a padded copy: rows x width, as the model has it
            self.timer.sync()
            self.profile.record(KV_COPY, len(keep), max(lengths), started)
        self.rows.extend(row for _, row in keep)
        self.profile.max_active_rows = max(self.profile.max_active_rows, len(self.rows))

    # ------------------------------------------------------------ decode
    def _decode_step(self) -> None:
        started, rows = time.perf_counter(), len(self.rows)
        with self.timer.phase("cache_ms"):
            self.runner.prepare_decode()
        attended = self.runner.store.front + 1  # the columns this step's forward attends over
        with self.timer.phase("decode_ms"):
            logits = self.runner.decode_logits()
            tokens, logprobs = self.selection.choose(logits, self.runner.seen, *self._stream_keys(), self._histories())
            tokens_host = tokens.tolist()  # the one host sync of the step
            logprobs_host = logprobs.tolist() if logprobs is not None else None
        self.profile.decode_forwards += 1
        self.runner.advance(tokens)
        for r, token in enumerate(tokens_host):
            self._append(r, token, logprobs_host)
        stopped = self._completes_stop_string(self.rows)
        survivors = [r for r, row in enumerate(self.rows) if not self._finish_if_done(row, stopped[r])]
        if len(survivors) < len(self.rows):
            keep = fill_holes_order(survivors)
            with self.timer.phase("cache_ms"):
                self._remember_finished(keep)
                self.runner.retire(keep)
                self.rows = [self.rows[r] for r in keep]
        if not self.runner.last_step_compiled:  # a compiling step would teach the cost model compile time
            self.profile.record(CB_STEP, rows, attended, started)

    def _remember_finished(self, keep: list[int]) -> None:
        """Finished rows' sequences into the prefix cache, before their cache rows are reused: the prompt
        and every generated token but the last (it was never fed, so it has no K/V)."""
        if self.prefix is None or not self.prefix.remembers:
            return
        kept = set(keep)
        for r, row in enumerate(self.rows):
            if r not in kept:
                sequence = [*self.prompts[row.prompt], *row.tokens[:-1]]
                self.prefix.remember(sequence, lambda start, r=r: self.runner.row_key_values(r, start))

    def _stream_keys(self) -> tuple[list[int], list[int], list[int]]:
        """(prompt, sample, step) per row: the sampler's stream keys and the EOS suppression's counts;
        greedy selection without it needs none."""
        if not self.selection.needs_steps:
            return [], [], []
        rows = self.rows
        return [row.prompt for row in rows], [row.sample for row in rows], [len(row.tokens) for row in rows]

    def _histories(self) -> list[list[int]]:
        """Each row's prompt and generated ids, where the selection's per-sequence processors read them."""
        if not self.selection.needs_histories:
            return []
        return [[*self.prompts[row.prompt], *row.tokens] for row in self.rows]

    def _append(self, r: int, token: int, logprobs_host: list[float] | None) -> None:
        row = self.rows[r]
        row.tokens.append(token)
        if logprobs_host is not None:
            row.logprobs.append(logprobs_host[r])

    def _completes_stop_string(self, rows: Sequence[_Row]) -> list[bool]:
        """Per row, whether its newest token completes a stop string (one batched match per step)."""
        if self.stops is None:
            return [False] * len(rows)
        return self.stops.completed([(self.prompts[row.prompt], row.tokens) for row in rows])

    def _finish_if_done(self, row: _Row, stopped: bool) -> bool:
        if row.tokens[-1] in self.eos:
            reason = "eos"
        elif stopped:
            reason = "stop"
        elif len(row.tokens) >= self.budgets[row.prompt]:
            reason = "length"
        else:
            return False
        self.finished[(row.prompt, row.sample)] = Finished(row.tokens, reason, row.logprobs)
        return True
