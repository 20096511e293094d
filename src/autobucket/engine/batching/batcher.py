"""Continuous batching, host side: the queue, the active rows, retained prefills and finish checks.

One loop serves every CB route; routes differ only in their admission policy, which splits each
admission's prompts into prefill groups (equal_width: one padded group; aligned: one group per
prompt; bucketed: the planner's padded, packed or chunked groups). All device work goes through a `ModelRunner`.

Work items are `Request` records, one per (prompt, sample), queued prompt-major. A prompt is prefilled
once; its K/V and last-token logits serve all of its `n` samples: each sample draws its own first token
from the shared logits, and the K/V is copied into one cache row per sample. When an admission ends in
the middle of a prompt's samples, the queued samples keep that prefill (`Request.prefill`) for the next
admission, so a prompt is never prefilled twice.

The only host sync per decode step is reading the new tokens back (`tolist`); EOS, stop-string and
budget checks happen on those host integers."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from autobucket.costs.coefficients import CB_STEP, KV_COPY, PREFILL_FORWARD
from autobucket.engine.batching.model_runner import ModelRunner, RowInsert
from autobucket.engine.batching.prefill import PrefillGroup, PrefillOutput, as_group
from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.batching.prefix_reuse import PrefixAdmission, PrefixReuse
from autobucket.engine.batching.static_cache import fill_holes_order
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import ResolvedSampling
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.request import PrefillRow, Request, call_requests
from autobucket.planning.forms import PADDED
from autobucket.profile import PhaseTimer, Profile

# A route's admission policy: the admission's prompt indices -> prefill groups (a plain list of prompt
# indices is a padded group).
AdmissionPolicy = Callable[[Sequence[int]], list[list[int]] | list[PrefillGroup]]

CONTINUED = "continued"  # a group whose prompts continue given K/V (from the prefix cache or a shared prefix)


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
        sampling: ResolvedSampling,
        profile: Profile,
        timer: PhaseTimer,
        prefix: PrefixReuse | None = None,
        stops: StopStrings | None = None,
    ) -> None:
        self.runner, self.sampling, self.selection, self.profile, self.timer = runner, sampling, sampling.selection, profile, timer
        self.stops = stops
        # None: every prompt prefilled whole, nothing remembered
        self.prefix = PrefixAdmission(prefix, runner, profile, timer) if prefix is not None else None
        self.prompts: Sequence[Sequence[int]] = ()
        self.eos = frozenset(sampling.eos_token_ids)
        self.rows: list[Request] = []  # the decoding requests, in cache-row order (`Request.cache_row`)
        self.finished: dict[tuple[int, int], Request] = {}

    @without_autograd
    def run(
        self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, admission_policy: AdmissionPolicy
    ) -> dict[tuple[int, int], Request]:
        """Finished requests keyed by (prompt index, sample index)."""
        self.prompts = prompts
        budgets, want_logprobs = self.sampling.budgets, self.selection.want_logprobs
        queue = deque(call_requests(prompts, admission_order(budgets), budgets, samples_per_prompt, want_logprobs))
        rows_limit = self.runner.cache_shape.continuous_batch_size
        while queue or self.rows:
            free_rows = rows_limit - len(self.rows)
            if queue and free_rows:
                admitted = [queue.popleft() for _ in range(min(free_rows, len(queue)))]
                self._admit(admitted, queue, admission_policy)
            if self.rows:
                self._decode_step()
        return self.finished

    # ------------------------------------------------------------ admission
    def _admit(self, admitted: list[Request], queue: deque[Request], policy) -> None:
        """Prefill the admitted requests' prompts that have no prefill yet and start their rows. The
        queue's next requests of a prompt prefilled here keep its prefill for the next admission."""
        prompts = self.prompts
        new_prompts = list(dict.fromkeys(r.prompt for r in admitted if r.prefill is None))
        hits = self.prefix.hits(prompts, new_prompts) if self.prefix is not None else {}
        whole = [p for p in new_prompts if p not in hits]
        groups = [as_group(b) for b in policy(whole)] if whole else []
        continued = self.prefix.continued_groups(prompts, hits) if self.prefix is not None else []
        self.profile.prefill_groups.append([list(g.prompts) for g in groups] + continued)
        self.profile.prefill_forms.append([g.form for g in groups] + [CONTINUED] * len(continued))
        # Widest group first: it sets the front, narrower groups then fit without a gap.
        work = [(g.prompts, lambda g=g: self._prefill(g, [prompts[i] for i in g.prompts])) for g in groups]
        work += [(tuple(c), lambda c=c: self._prefill_continued(c, hits)) for c in continued]
        prefilled: dict[int, PrefillRow] = {}
        for _, run in sorted(work, key=lambda item: -max(len(prompts[i]) for i in item[0])):
            prefilled.update(run())
        for request in itertools.chain(admitted, itertools.takewhile(lambda r: r.prompt in prefilled, queue)):
            if request.prefill is None:
                request.prefill = prefilled[request.prompt]
        by_output: dict[int, list[Request]] = {}
        for request in admitted:
            by_output.setdefault(id(request.prefill.output), []).append(request)
        for members in by_output.values():
            # In the output's row order (stable: a prompt's samples keep theirs), so a group whose rows are
            # all admitted is copied into the cache as one block instead of being gathered into a copy first
            # (continued groups came back in another order than the queue's: a whole extra K/V copy each).
            members.sort(key=lambda request: request.prefill.row)
            self._start_samples(members)

    def _prefill(self, group: PrefillGroup, group_prompts: list[Sequence[int]]) -> dict[int, PrefillRow]:
        with self.timer.phase("prefill_ms"):
            started = time.perf_counter()
            output, seen = self.runner.prefill(group_prompts, group.form, group.chunk_tokens)
            self.timer.sync()
            if group.form == PADDED:  # the timing model is of padded forwards; packed/chunked are not fed to it
                self.profile.record(PREFILL_FORWARD, len(group.prompts), max(map(len, group_prompts)), started)
        self.profile.prefill_forwards += output.forwards
        self.profile.prefill_tokens += output.tokens
        return {p: PrefillRow(output, b, None if seen is None else seen[b]) for b, p in enumerate(group.prompts)}

    def _prefill_continued(self, group: list[int], hits: dict[int, PrefixHit]) -> dict[int, PrefillRow]:
        output, seen = self.prefix.prefill_continued(group, hits, self.prompts)
        return {p: PrefillRow(output, b, None if seen is None else seen[b]) for b, p in enumerate(group)}

    def _start_samples(self, members: list[Request]) -> None:
        """First tokens of `members` (all prefilled in one output) from the shared prefill logits."""
        output = members[0].prefill.output
        source_rows = [r.prefill.row for r in members]
        seen = torch.stack([r.prefill.seen for r in members]) if self.runner.seen is not None else None
        with self.timer.phase("prefill_ms"):
            index = torch.tensor(source_rows, dtype=torch.long, device=self.runner.device)
            histories = [r.prompt_ids for r in members] if self.selection.needs_histories else ()
            tokens, logprobs = self.selection.choose(
                output.last_logits[index], seen, [r.prompt for r in members], [r.sample for r in members],
                [0] * len(members), histories,
            )
        tokens_host = tokens.tolist()
        logprobs_host = logprobs.tolist() if logprobs is not None else None
        for b, (request, token) in enumerate(zip(members, tokens_host, strict=True)):
            self._append(request, token, logprobs_host, b)
        keep = []
        for b, (request, stopped) in enumerate(zip(members, self._completes_stop_string(members), strict=True)):
            if not self._finish_if_done(request, stopped):
                keep.append(b)
            elif self.prefix is not None:  # its K/V is the prompt's own
                length = len(request.prompt_ids)
                self.prefix.remember(request.prompt_ids, lambda start, b=b, n=length: output.prompt_key_values(source_rows[b], n, start))
        if keep:
            with self.timer.phase("cache_ms"):
                self._insert(output, source_rows, tokens, seen, [members[b] for b in keep], keep)
        for request in members:  # the cache row holds the K/V now (or the request has finished)
            request.prefill = None

    def _insert(self, output: PrefillOutput, source_rows: list[int], tokens, seen, kept: list[Request], keep: list[int]) -> None:
        """The `kept` requests (`keep`: their positions in `source_rows` and `tokens`) into the next cache rows."""
        index = torch.tensor(keep, dtype=torch.long, device=self.runner.device)
        first, seen = tokens[index], (seen[index] if seen is not None else None)
        if seen is not None:
            seen[torch.arange(len(keep), device=self.runner.device), first] = True
        lengths = [len(request.prompt_ids) for request in kept]
        # The first insert also allocates the cache (a per-call cost): only later copies are KV-copy timings.
        allocates, started = self.runner.store is None, time.perf_counter()
        self.profile.shared_kv_rows += self.runner.insert(output, RowInsert([source_rows[b] for b in keep], first, lengths, seen))
        if not allocates and output.segments is None:  # a padded copy: rows x width, as the model has it
            self.timer.sync()
            self.profile.record(KV_COPY, len(keep), max(lengths), started)
        groups = self.runner.store.prefix_of
        for row, request in enumerate(kept, start=len(self.rows)):
            request.cache_row = row
            request.shared_prefix = groups[row] if groups[row] >= 0 else None
        self.rows.extend(kept)
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
            self._append(self.rows[r], token, logprobs_host, r)
        stopped = self._completes_stop_string(self.rows)
        survivors = [r for r, request in enumerate(self.rows) if not self._finish_if_done(request, stopped[r])]
        if len(survivors) < len(self.rows):
            keep = fill_holes_order(survivors)
            with self.timer.phase("cache_ms"):
                self._remember_finished(keep)
                self.runner.retire(keep)
                self._keep_rows(keep)
        if not self.runner.last_step_compiled:  # a compiling step would teach the cost model compile time
            self.profile.record(CB_STEP, rows, attended, started)

    def _keep_rows(self, keep: list[int]) -> None:
        """Only the requests of cache rows `keep` stay, in that order (as `ModelRunner.retire` compacted them:
        the last rows move into the holes, the others keep theirs)."""
        self.rows = [self.rows[r] for r in keep]
        for row, old in enumerate(keep):
            if row != old:
                self.rows[row].cache_row = row

    def _remember_finished(self, keep: list[int]) -> None:
        """Finished rows' sequences into the prefix cache, before their cache rows are reused: the prompt
        and every generated token but the last (it was never fed, so it has no K/V)."""
        if self.prefix is None or not self.prefix.remembers:
            return
        kept = set(keep)
        for r, request in enumerate(self.rows):
            if r not in kept:
                sequence = [*request.prompt_ids, *request.tokens[:-1]]
                self.prefix.remember(sequence, lambda start, r=r: self.runner.row_key_values(r, start))

    def _stream_keys(self) -> tuple[list[int], list[int], list[int]]:
        """(prompt, sample, step) per row: the sampler's stream keys and the EOS suppression's counts;
        greedy selection without it needs none."""
        if not self.selection.needs_steps:
            return [], [], []
        rows = self.rows
        return [r.prompt for r in rows], [r.sample for r in rows], [len(r.tokens) for r in rows]

    def _histories(self) -> list[list[int]]:
        """Each row's prompt and generated ids, where the selection's per-sequence processors read them."""
        if not self.selection.needs_histories:
            return []
        return [[*r.prompt_ids, *r.tokens] for r in self.rows]

    @staticmethod
    def _append(request: Request, token: int, logprobs_host: list[float] | None, index: int) -> None:
        request.tokens.append(token)
        if logprobs_host is not None:
            request.logprobs.append(logprobs_host[index])

    def _completes_stop_string(self, requests: Sequence[Request]) -> list[bool]:
        """Per request, whether its newest token completes a stop string (one batched match per step)."""
        if self.stops is None:
            return [False] * len(requests)
        return self.stops.completed([(r.prompt_ids, r.tokens) for r in requests])

    def _finish_if_done(self, request: Request, stopped: bool) -> bool:
        reason = request.finish_reason_now(self.eos, stopped)
        if reason is None:
            return False
        request.finish_reason, request.cache_row = reason, None
        self.finished[request.key] = request
        return True
