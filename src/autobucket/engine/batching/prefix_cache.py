"""A prefix KV cache across `generate` calls: prefilled K/V keyed by token-id prefixes *and* by the
weights' version, so a multi-turn conversation's next turn prefills only its new tokens and a reuse
after a weight update is impossible.

Layout: a tree of blocks of at most `BLOCK_TOKENS` tokens. The root is empty; a node's children are
keyed by their tokens, so a full block is found by one dict lookup and a prompt that diverges inside
a block still reuses the common part of it (a scan of that node's few children). Only full blocks have
children: a shorter block is always the tail of the sequence that made it, and a longer sequence with
the same start replaces it. A node holds its block's K/V for every layer, `[layers, 2, kv_heads,
tokens, head_dim]` (2: keys, values), copied out of the static cache, so nothing it holds aliases the
engine's buffers. K/V at position i depends on tokens 0..i only (causal attention, positions counted
from 0 in every route), so any common prefix of two sequences has the same K/V.

Versions: `weights_version(model)` (`model_access/weight_versions.py`) is the parameters'
`(data_ptr, _version)`, the process's optimizer steps (fused optimizers do not bump `_version`), a peft
model's adapter state (active, disabled, merged, scaling), the attention backend and the kernels; any
change clears the whole cache before the next lookup (an entry of old weights can never be served again,
so keeping it would only hold memory). `Rollout.refresh_weights()`
clears it too, for writes that bypass version counters (`param.data` copies).

Eviction: least recently used first, a node with its subtree (a block is useless without its
ancestors). A lookup or insert touches its path leaf first, so ancestors are always more recent than
their descendants. A sequence whose new blocks alone exceed the budget is not cached (never an error).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

BLOCK_TOKENS = 16  # tokens per node: one dict lookup per 16 prompt tokens
# Fewer cached tokens than this are not worth a continued forward: every chat-templated prompt shares a
# few template tokens, and continuing from them would only split prefill groups.
MIN_HIT_TOKENS = BLOCK_TOKENS

# start -> (keys, values) of a sequence's tokens from `start` on, per layer [kv_heads, tokens, head_dim]
KeyValuesFrom = Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]


@dataclass(eq=False)  # identity hash: nodes are OrderedDict keys
class _Node:
    tokens: tuple[int, ...]  # this block's tokens (BLOCK_TOKENS, or fewer at a sequence's tail)
    kv: torch.Tensor | None  # [layers, 2, kv_heads, len(tokens), head_dim]; None at the root
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass
class PrefixHit:
    """The cached K/V of a prompt's first `tokens` tokens."""

    tokens: int
    keys: list[torch.Tensor]  # per layer [kv_heads, tokens, head_dim]
    values: list[torch.Tensor]
    shared: bool = False  # True: a prefix prefilled once in this call for several prompts, not from the cache


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made (a `Profile` reads their change over one call)."""

    hits: int = 0  # prompts served a cached prefix
    cached_tokens: int = 0  # prompt tokens whose K/V came from the cache
    inserted_sequences: int = 0
    skipped_sequences: int = 0  # larger than the whole budget: not cached
    evicted_blocks: int = 0
    invalidations: int = 0  # clears after a weight change or refresh_weights()


class PrefixCache:
    """Prefilled K/V of token prefixes under one weights version, within `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.root = _Node((), None, None)
        self.version: tuple | None = None
        self.used_bytes = 0
        self.stats = PrefixCacheStats()
        self._recency: OrderedDict[_Node, None] = OrderedDict()  # least recently used first

    @property
    def blocks(self) -> int:
        return len(self._recency)

    # ------------------------------------------------------------ versions
    def use_version(self, version: tuple) -> bool:
        """Serve only entries made under `version`: a different one clears the cache first. Returns
        whether entries of another version were dropped."""
        if version == self.version:
            return False
        dropped = bool(self._recency)
        self.stats.invalidations += dropped
        self.clear()
        self.version = version
        return dropped

    def clear(self) -> None:
        self.root.children.clear()
        self._recency.clear()
        self.used_bytes = 0

    def invalidate(self) -> None:
        """Weights changed where no version counter saw it (`Rollout.refresh_weights()`)."""
        if self._recency:
            self.stats.invalidations += 1
        self.clear()
        self.version = None

    # ------------------------------------------------------------ lookup
    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of `prompt`, leaving at least its last token to prefill (its logits
        start generation); None when less than `MIN_HIT_TOKENS` of it is cached."""
        matched, path, pieces = self._match(prompt)
        if matched < MIN_HIT_TOKENS:
            return None
        self._touch(path)
        self.stats.hits += 1
        self.stats.cached_tokens += matched
        kv = torch.cat(pieces, dim=3) if len(pieces) > 1 else pieces[0]  # [layers, 2, kv_heads, matched, head_dim]
        return PrefixHit(matched, list(kv[:, 0]), list(kv[:, 1]))

    def cached_length(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s tokens `lookup` would serve (0: none), without using the entry."""
        matched = self._match(prompt)[0]
        return matched if matched >= MIN_HIT_TOKENS else 0

    def _match(self, prompt: Sequence[int]) -> tuple[int, list[_Node], list[torch.Tensor]]:
        """(tokens matched, the nodes on their path, their K/V pieces) for `prompt` minus its last token."""
        limit = len(prompt) - 1
        node, matched, path, pieces = self.root, 0, [], []
        while matched < limit:
            take = min(BLOCK_TOKENS, limit - matched)
            want = tuple(prompt[matched : matched + take])
            child = node.children.get(want) if take == BLOCK_TOKENS else None
            if child is not None:
                node, matched = child, matched + take
                path.append(child)
                pieces.append(child.kv)
                continue
            best, best_tokens = _longest_common_child(node, want)
            if best is not None:
                path.append(best)
                pieces.append(best.kv[:, :, :, :best_tokens])
                matched += best_tokens
            break
        return matched, path, pieces

    # ------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], key_values: KeyValuesFrom) -> None:
        """Cache the K/V of `tokens`. `key_values(start)` gives the K/V of `tokens[start:]`, keys[l] and
        values[l] `[kv_heads, len(tokens) - start, head_dim]`; it is called only when something is new."""
        node, start, path = self.root, 0, []
        while start < len(tokens):  # the blocks cached already
            child = node.children.get(tuple(tokens[start : start + BLOCK_TOKENS]))
            if child is None:
                break
            path.append(child)
            node, start = child, start + len(child.tokens)
        new_blocks = [(begin, tuple(tokens[begin : begin + BLOCK_TOKENS])) for begin in range(start, len(tokens), BLOCK_TOKENS)]
        if len(new_blocks) == 1 and _covered(node, new_blocks[0][1]):
            new_blocks = []  # only a tail, and a longer block with its tokens is cached already
        if not new_blocks:
            self._touch(path)
            return
        keys, values = key_values(new_blocks[0][0])
        first = new_blocks[0][0]
        assert keys[0].shape[1] == len(tokens) - first, "one K/V column per token"
        needed = sum(_block_bytes(keys, len(block)) for _, block in new_blocks)
        if needed > self.budget_bytes:
            self.stats.skipped_sequences += 1
            return
        self._touch(path)
        self._evict_until_free(needed, keep=set(path))
        parent = path[-1] if path else self.root
        made = []
        for begin, block in new_blocks:
            columns = slice(begin - first, begin - first + len(block))
            # [layers, 2, kv_heads, block, head_dim]: a copy, so the block holds only its own bytes
            kv = torch.stack([torch.stack((k[:, columns], v[:, columns])) for k, v in zip(keys, values, strict=True)])
            parent = self._add_child(parent, block, kv)
            made.append(parent)
        self._touch(made)
        self.stats.inserted_sequences += 1

    def _add_child(self, parent: _Node, block: tuple[int, ...], kv: torch.Tensor) -> _Node:
        for tokens, child in list(parent.children.items()):
            if len(tokens) < len(block) and block[: len(tokens)] == tokens:
                self._remove(child)  # a shorter tail block this one extends
        node = _Node(block, kv, parent)
        parent.children[block] = node
        self._recency[node] = None
        self.used_bytes += node.nbytes
        return node

    # ------------------------------------------------------------ eviction
    def _touch(self, path: Sequence[_Node]) -> None:
        """Mark `path` (root to leaf) most recently used, leaf first so ancestors end up newer."""
        for node in reversed(path):
            self._recency.move_to_end(node)

    def _evict_until_free(self, needed: int, keep: set[_Node]) -> None:
        while self.used_bytes + needed > self.budget_bytes:
            victim = next((n for n in self._recency if n not in keep), None)
            if victim is None:
                return
            self.stats.evicted_blocks += self._remove(victim)

    def _remove(self, node: _Node) -> int:
        """Drop `node` and its subtree; returns the blocks dropped."""
        removed, stack = 0, [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            self._recency.pop(current, None)
            self.used_bytes -= current.nbytes
            removed += 1
        del node.parent.children[node.tokens]
        return removed


def _longest_common_child(node: _Node, want: tuple[int, ...]) -> tuple[_Node | None, int]:
    """The child sharing the most leading tokens with `want`, and how many."""
    best, best_tokens = None, 0
    for tokens, child in node.children.items():
        common = 0
        for a, b in zip(tokens, want, strict=False):
            if a != b:
                break
            common += 1
        if common > best_tokens:
            best, best_tokens = child, common
    return best, best_tokens


def _covered(node: _Node, block: tuple[int, ...]) -> bool:
    """A child of `node` starts with all of `block`."""
    return any(tokens[: len(block)] == block for tokens in node.children)


def _block_bytes(keys: Sequence[torch.Tensor], tokens: int) -> int:
    k = keys[0]  # [kv_heads, tokens, head_dim]
    return 2 * len(keys) * k.shape[0] * tokens * k.shape[2] * k.element_size()
