"""`RunningBatch`: the rows the asynchronous engine decodes, on one `ModelRunner` and one static KV cache
kept for the engine's life.

It reuses the continuous-batching parts `Rollout.generate` runs (`ModelRunner.prefill`, `insert`,
`decode_logits`, `retire`, `Selection`), but its rows come and go between any two steps.

Admission, where the plan runs shared-prefix attention (`shared_prompts.py`): a request alone with its
prompt in flight has its context prefilled and copied into its row. Requests with equal prompt ids
read one copy of the prompt's K/V once two of them are in flight: a fresh request (nothing generated
yet) chooses its first token from the prompt's kept last logits and owns no columns yet; a request with
tokens after its prompt (resumed with `generated`, or re-prefilled) prefills only those, continuing from
the copy, and owns their columns. Elsewhere each distinct context is prefilled and copied into one row
per request that has it. Several prefills share a forward only where that is exact
(`prefill_forwards.py`).

Decode: one step of every row in the plan's decode form (the engine's Llama-family step where it may
stand in for the model's forward, else the model's forward), rows reading a shared copy through the
shared-prefix attention, as in a `Rollout.generate` call.

Re-prefill (after a weight update): every row's K/V is dropped and its context (prompt, earlier tokens and
its own so far) prefilled again under the new weights; its next token comes from that prefill, exactly
as if the request had been submitted afresh with its tokens so far."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.batching.static_cache import fill_holes_order
from autobucket.engine.decode.forms import ENGINE, decode_form
from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.intercept.attention import dispatches
from autobucket.engine.model_access.hf_compat import ForwardSpec
from autobucket.engine.plan.forward_plan import ForwardPlan
from autobucket.engine.routes import eager_decode_attention
from autobucket.planning.forms import PACKED, PADDED
from autobucket.serving.prefill_forwards import forward_batches
from autobucket.serving.request import Request
from autobucket.serving.shared_prompts import SharedPrompt, SharedPrompts
from autobucket.serving.token_choice import choose_tokens


class RunningBatch:
    """Active requests, one per cache row (in row order)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ForwardSpec,
        shape: CacheShape,
        pad_token_id: int,
        vocab_size: int,
        packing: bool = True,
        prefill_max_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.runner = ModelRunner(model, spec, shape, pad_token_id, vocab_size, track_seen=False)
        self.requests: list[Request] = []
        self.prompts = SharedPrompts()  # the prompts whose one copy rows read (shared-prefix mode)
        self.packing, self.prefill_max_tokens = packing, prefill_max_tokens
        self.shares = self.together = False  # set from the plan (`follow_plan`) before each step's work
        self._plan_followed = False
        self.prefill_forwards = 0  # forwards run to prefill (counters for tests and profiles)
        self.copies_made = 0  # shared copies of prompts' K/V made

    @property
    def free_rows(self) -> int:
        return self.runner.cache_shape.continuous_batch_size - len(self.requests)

    def follow_plan(self, plan: ForwardPlan, model_changed: bool) -> None:
        """This step's plan: whether rows share prompts' copies, whether prefills pack, and (at the first
        step and after the model changed: modules, hooks, adapters) the decode step's form."""
        self.shares = plan.shares_prefixes
        self.together = self.packing and plan.kernel_set != "torch" and dispatches(self.model)
        self.runner.decode_attention = eager_decode_attention(plan)
        if model_changed or not self._plan_followed:
            runner = self.runner
            runner.parts = LlamaParts.of(self.model) if plan.decode_step == ENGINE else None
            runner.decode_step = decode_form(runner.parts is not None, False)
            self._plan_followed = True

    def admit(self, requests: Sequence[Request], version: int) -> None:
        """Start the requests' rows (a request whose first token ends it finishes without a row)."""
        if not requests:
            return
        if not self.shares:
            self._admit_copies(requests, version)
            return
        in_flight = collections.Counter(request.prompt_key for request in self.requests)
        by_prompt: dict[tuple[int, ...], list[Request]] = {}
        for request in requests:
            by_prompt.setdefault(request.prompt_key, []).append(request)
        sharing = {p: members for p, members in by_prompt.items() if len(members) + in_flight[p] >= 2}
        lone = [members[0] for p, members in by_prompt.items() if p not in sharing]
        unknown = [p for p in sharing if p not in self.prompts]
        placed = self._prefill_whole([list(p) for p in unknown] + [r.context for r in lone])
        for prompt, (output, row) in zip(unknown, placed, strict=False):
            key_values = output.prompt_key_values(row, len(prompt), 0, copy=True)
            self.prompts[prompt] = SharedPrompt(len(prompt), output.last_logits[row].clone(), key_values)
        for prompt in sharing:
            shared = self.prompts[prompt]
            if shared.copy is None and shared.key_values is None:  # its K/V is in the first request's row
                shared.key_values = self._prompt_of_row(prompt)
        members = [request for group in sharing.values() for request in group]
        fresh, continued = [r for r in members if not r.own_ids], [r for r in members if r.own_ids]
        self._start_lone(lone, placed[len(unknown) :], version)
        self._start_fresh(fresh, version)
        self._start_continued(continued, version)
        self.prompts.follow_rows(self.requests, self.runner.store)

    def step(self, version: int) -> None:
        """One decode step of every row; finished requests leave their rows."""
        self.runner.prepare_decode()
        logits = self.runner.decode_logits()
        tokens, logprobs = choose_tokens(self.requests, logits)
        self.runner.advance(tokens)
        host = tokens.tolist()  # the one host sync of the step
        finished = {r for r, request in enumerate(self.requests) if self._record(request, host[r], logprobs[r], version)}
        self._retire(lambda r: r not in finished)

    def remove(self, leaving: Callable[[Request], bool], reason: str) -> list[Request]:
        """Free the rows of the requests `leaving` picks, finished with `reason`; returns them."""
        gone = [request for request in self.requests if leaving(request)]
        if gone:
            self._retire(lambda r: not leaving(self.requests[r]))
            for request in gone:
                request.finish(reason)
        return gone

    def reprefill(self, version: int) -> None:
        """Recompute every row's K/V under the weights as they are now (see the module docstring)."""
        requests = self.clear()
        self.admit(requests, version)

    def clear(self) -> list[Request]:
        """Drop every row and shared copy (nothing finished); returns their requests, in row order."""
        requests = self.requests
        if self.runner.store is not None:
            self._retire(lambda r: False)
        self.requests = []
        self.prompts.clear()
        return requests

    # ------------------------------------------------------------ shared prompts
    def _start_fresh(self, requests: list[Request], version: int) -> None:
        """Requests with nothing after their prompt: first tokens from the prompt's last logits, rows
        reading its copy and owning no column yet."""
        if not requests:
            return
        logits = torch.stack([self.prompts[r.prompt_key].last_logits for r in requests])
        tokens, logprobs = choose_tokens(requests, logits)
        host = tokens.tolist()
        keep = [b for b, request in enumerate(requests) if not self._record(request, host[b], logprobs[b], version)]
        for prompt, members in _by_prompt(requests, keep):
            shared = self.prompts[prompt]
            first = tokens[torch.tensor(members, dtype=torch.long, device=self.runner.device)]
            self._insert_sharing(shared, RowInsert([0] * len(members), first, [len(prompt)] * len(members), None))
            self.requests.extend(requests[b] for b in members)

    def _start_continued(self, requests: list[Request], version: int) -> None:
        """Requests with tokens after their prompt: only those prefilled, continuing from the prompt's
        copy; each row owns their columns."""
        lengths = [len(r.own_ids) for r in requests]
        for batch in forward_batches(lengths, self.together, self.prefill_max_tokens, padded=True):
            members = [requests[i] for i in batch]
            contexts = [r.context for r in members]
            hits = [self.prompts[r.prompt_key].hit(self.runner.store) for r in members]
            output, _ = self.runner.prefill_continued(hits, contexts, None)
            self.prefill_forwards += output.forwards
            tokens, logprobs = choose_tokens(members, output.last_logits)
            host = tokens.tolist()
            keep = [b for b, request in enumerate(members) if not self._record(request, host[b], logprobs[b], version)]
            width = output.keys[0].shape[2]
            for prompt, rows in _by_prompt(members, keep):
                own = [(b, width - lengths[batch[b]], width) for b in rows]
                first = tokens[torch.tensor(rows, dtype=torch.long, device=self.runner.device)]
                insert = RowInsert(rows, first, [len(contexts[b]) for b in rows], None)
                self._insert_sharing(self.prompts[prompt], insert, (output.keys, output.values, own))
                self.requests.extend(members[b] for b in rows)

    def _start_lone(self, requests: list[Request], placed: list[tuple[PrefillOutput, int]], version: int) -> None:
        """Requests alone with their prompt in flight: their context prefilled whole, a row holding it
        (a fresh one's prompt logits kept, for a sibling joining later)."""
        if not requests:
            return
        logits = torch.stack([output.last_logits[row] for output, row in placed])
        lengths = [len(request.context) for request in requests]
        tokens, logprobs = choose_tokens(requests, logits)
        host = tokens.tolist()
        for b, (request, (output, row)) in enumerate(zip(requests, placed, strict=True)):
            if not request.own_ids:
                self.prompts[request.prompt_key] = SharedPrompt(lengths[b], logits[b].clone())
            if not self._record(request, host[b], logprobs[b], version):
                self.runner.insert(output, RowInsert([row], tokens[b : b + 1], [lengths[b]], None))
                self.requests.append(request)

    def _prompt_of_row(self, prompt: tuple[int, ...]):
        """The prompt's K/V, copied out of the row of its one request that holds it itself."""
        store = self.runner.store
        row = next(r for r, request in enumerate(self.requests) if request.prompt_key == prompt and store.prefix_of[r] < 0)
        keys, values = self.runner.row_key_values(row, 0)
        return [k[:, : len(prompt)].clone() for k in keys], [v[:, : len(prompt)].clone() for v in values]

    def _insert_sharing(self, shared: SharedPrompt, rows: RowInsert, own=None) -> None:
        made = shared.copy is None
        shared.now_held(self.runner.insert_sharing(shared.held(), rows, own))
        self.copies_made += int(made)

    # ------------------------------------------------------------ per-row copies
    def _admit_copies(self, requests: Sequence[Request], version: int) -> None:
        """Prefill each distinct context once and copy it into one row per request that has it."""
        by_context: dict[tuple[int, ...], list[Request]] = {}
        for request in requests:
            by_context.setdefault(tuple(request.context), []).append(request)
        contexts = [list(context) for context in by_context]
        for context, (output, row) in zip(contexts, self._prefill_whole(contexts), strict=True):
            members = by_context[tuple(context)]
            tokens, logprobs = choose_tokens(members, output.last_logits[row].expand(len(members), -1))
            host = tokens.tolist()
            keep = [b for b, request in enumerate(members) if not self._record(request, host[b], logprobs[b], version)]
            if keep:
                index = torch.tensor(keep, dtype=torch.long, device=self.runner.device)
                self.runner.insert(output, RowInsert([row] * len(keep), tokens[index], [len(context)] * len(keep), None))
                self.requests.extend(members[b] for b in keep)

    def _prefill_whole(self, contexts: list[list[int]]) -> list[tuple[PrefillOutput, int]]:
        """Per context: the prefill output holding it and its row (or segment) there."""
        placed = []
        for batch in forward_batches([len(c) for c in contexts], self.together, self.prefill_max_tokens):
            output, _ = self.runner.prefill([contexts[i] for i in batch], PACKED if len(batch) > 1 else PADDED)
            self.prefill_forwards += output.forwards
            placed.extend((output, row) for row in range(len(batch)))
        return placed

    # ------------------------------------------------------------ finishing
    def _record(self, request: Request, token: int, logprob: float | None, version: int) -> bool:
        """Add `token` to `request`; True when that finished it, or it had ended already (aborted from
        another thread while this step ran: the token is dropped)."""
        if not request.add_token(token, logprob, version):
            return True
        stopped = request.stops is not None and request.stops.completed(
            [([*request.prompt_ids, *request.generated], request.tokens)]
        )[0]
        reason = request.reason_to_finish(stopped)
        if reason is not None:
            request.finish(reason)
        return reason is not None

    def _retire(self, stays: Callable[[int], bool]) -> None:
        keep = fill_holes_order([r for r in range(len(self.requests)) if stays(r)])
        self.runner.retire(keep)
        self.requests = [self.requests[r] for r in keep]
        self.prompts.follow_rows(self.requests, self.runner.store)  # a copy whose last reader left was dropped with it


def _by_prompt(requests: Sequence[Request], indices: Sequence[int]) -> list[tuple[tuple[int, ...], list[int]]]:
    """`indices` of `requests` grouped by prompt ids (each group in order; groups in first appearance)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index in indices:
        groups.setdefault(requests[index].prompt_key, []).append(index)
    return list(groups.items())
