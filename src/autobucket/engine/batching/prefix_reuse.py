"""Prefix reuse in one call's admissions: which prompts start from K/V that is already there, and
prefilling the rest of them.

Two sources of such K/V:
- the prefix cache across calls (`prefix_cache.py`): a prompt that extends a cached sequence (the
  next turn of a conversation) is a *hit* for the cached part;
- prefixes shared inside the call (`planning/shared_prefix.py`): prompts of an admission that start
  with the same tokens (a system prompt) have that prefix prefilled once here, and every member is a
  hit for it; later admissions of the call reuse the same prefill.
Hits are prefilled only after their given part (`continued_prefill.py`), grouped by the route's
continuation policy. Finished sequences enter the cache through `remember`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autobucket.engine.batching.model_runner import ModelRunner
from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.batching.prefix_cache import KeyValuesFrom, PrefixCache, PrefixHit
from autobucket.planning.forms import CHUNKED, PADDED
from autobucket.planning.shared_prefix import SharedPrefix
from autobucket.profile import PhaseTimer, Profile


@dataclass
class PrefixReuse:
    """How a call reuses prefixes: the prefix cache across calls (None: off), shared prefixes found in
    each admission (`share`: the admitted prompts -> the prefixes worth prefilling once; None: off), and
    how the continued prompts are grouped: (prompt indices, their suffix lengths) -> groups of those
    indices, each one continued forward (or chunks of at most `chunk_tokens`)."""

    cache: PrefixCache | None
    group_suffixes: Callable[[Sequence[int], Sequence[int]], list[list[int]]]
    chunk_tokens: int | None
    share: Callable[[list[Sequence[int]]], list[SharedPrefix]] | None = None


class PrefixAdmission:
    """One call's side of `PrefixReuse`: finds the admissions' hits and prefills what they lack."""

    def __init__(self, reuse: PrefixReuse, runner: ModelRunner, profile: Profile, timer: PhaseTimer) -> None:
        self.reuse, self.runner, self.profile, self.timer = reuse, runner, profile, timer
        self.shared: dict[tuple[int, ...], PrefixHit] = {}  # prefixes shared in this call, for refills

    def hits(self, prompts: Sequence[Sequence[int]], new_prompts: list[int]) -> dict[int, PrefixHit]:
        """Prompt index -> the K/V its first tokens start from, for the admission's new prompts that have
        some: cached first, then shared inside the call (prefilled here, once)."""
        hits = self._cached(prompts, new_prompts)
        hits.update(self._shared(prompts, [p for p in new_prompts if p not in hits]))
        return hits

    def continued_groups(self, prompts: Sequence[Sequence[int]], hits: dict[int, PrefixHit]) -> list[list[int]]:
        if not hits:
            return []
        indices = list(hits)
        return self.reuse.group_suffixes(indices, [len(prompts[p]) - hits[p].tokens for p in indices])

    def prefill_continued(self, group: list[int], hits: dict[int, PrefixHit], prompts: Sequence[Sequence[int]]):
        """The group's prompts prefilled after their hits -> (output, seen) as `ModelRunner.prefill`."""
        group_hits = [hits[p] for p in group]
        with self.timer.phase("prefill_ms"):
            output, seen = self.runner.prefill_continued(group_hits, [prompts[p] for p in group], self.reuse.chunk_tokens)
            self.timer.sync()
        output.shared_prefixes = [hit if hit.shared else None for hit in group_hits]
        profile = self.profile
        profile.prefill_forwards += output.forwards
        profile.prefill_tokens += output.tokens
        profile.cached_prompt_tokens += sum(hit.tokens for hit in group_hits if not hit.shared)
        profile.shared_prompt_tokens += sum(hit.tokens for hit in group_hits if hit.shared)
        profile.prefix_cache_hits += sum(not hit.shared for hit in group_hits)
        return output, seen

    def remember(self, tokens: Sequence[int], key_values: KeyValuesFrom) -> None:
        """A finished sequence (the tokens with K/V) into the prefix cache, when there is one."""
        if self.reuse.cache is not None:
            self.reuse.cache.insert(tokens, key_values)

    @property
    def remembers(self) -> bool:
        return self.reuse.cache is not None

    # ------------------------------------------------------------ the two sources
    def _cached(self, prompts: Sequence[Sequence[int]], new_prompts: list[int]) -> dict[int, PrefixHit]:
        if self.reuse.cache is None:
            return {}
        hits = {p: self.reuse.cache.lookup(prompts[p]) for p in new_prompts}
        return {p: hit for p, hit in hits.items() if hit is not None}

    def _shared(self, prompts: Sequence[Sequence[int]], whole: list[int]) -> dict[int, PrefixHit]:
        """Prefill each shared prefix of the admission's uncached prompts once: a hit for every member."""
        if self.reuse.share is None:
            return {}
        hits = {p: hit for p in whole if (hit := self._earlier_shared(prompts[p])) is not None}
        rest = [p for p in whole if p not in hits]
        for shared in self.reuse.share([prompts[p] for p in rest]) if len(rest) > 1 else []:
            tokens = tuple(prompts[rest[shared.members[0]]][: shared.tokens])
            self.shared[tokens] = self._prefill_prefix(tokens)
            hits.update({rest[m]: self.shared[tokens] for m in shared.members})
        return hits

    def _earlier_shared(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest prefix shared in an earlier admission of this call that `prompt` continues."""
        matches = [
            hit for tokens, hit in self.shared.items() if len(prompt) > len(tokens) and tuple(prompt[: len(tokens)]) == tokens
        ]
        return max(matches, key=lambda hit: hit.tokens, default=None)

    def _prefill_prefix(self, tokens: Sequence[int]) -> PrefixHit:
        limit = self.reuse.chunk_tokens
        chunked = limit is not None and len(tokens) > limit
        with self.timer.phase("prefill_ms"):
            output, _ = self.runner.prefill([tokens], CHUNKED if chunked else PADDED, limit if chunked else None)
            self.timer.sync()
        self.profile.prefill_forwards += output.forwards
        self.profile.prefill_tokens += output.tokens
        self.profile.shared_prefixes += 1
        key_values = _prompt_key_values(output, len(tokens))
        self.remember(tokens, key_values)  # refills and later calls find it in the cache too
        keys, values = key_values(0)
        return PrefixHit(len(tokens), keys, values, shared=True)


def _prompt_key_values(output: PrefillOutput, length: int) -> KeyValuesFrom:
    return lambda start: output.prompt_key_values(0, length, start)
