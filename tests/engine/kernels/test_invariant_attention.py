"""`kernels="invariant"`: the batch-invariant attention kernel and end-to-end batch invariance.

Oracles: `F.scaled_dot_product_attention` on the same inputs, K/V heads repeated for grouped-query
attention (the kernel's values: fp32 within 1e-5, bf16 within bf16 rounding of an fp32 reference); the
same token's output in a whole-sequence causal prefill (the kernel's invariance, bitwise: decode over its
prefix, chunks over a cached prefix, a padded static-cache batch with a gap, a packed row); and a prompt
generated alone (end to end, bitwise tokens and logprobs: the same prompt inside a batch of 32 with
refill, on every route, and every route against every other).
Negative controls: SDPA on the same layouts, `kernels="torch"` end to end, and the invariant linears over
transformers' SDPA end to end fail the same bitwise checks somewhere (so those checks can fail).
Errors: masks the kernel cannot take (per head, an additive bias), softcapped attention and a model loaded
with eager attention are refused, naming the way out."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from workloads import ARCHS, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels import library
from autobucket.engine.kernels.invariant_attention import (
    allowed_for,
    invariant_attention,
    invariant_attention_shared,
    invariant_sdpa,
    shared_prefix_tiles,
)
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.onednn_probes import onednn_available

pytestmark = pytest.mark.usefixtures("single_thread")

needs_onednn = pytest.mark.skipif(not onednn_available(torch.float32), reason="no oneDNN on this torch build")
BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1e-2)


# ---- the kernel's values ----------------------------------------------------------------------------------


def sdpa(query, key, value, mask, causal):
    """[rows, heads, queries, D] x [rows, kv_heads, columns, D] -> [rows, queries, heads, D] by torch's SDPA,
    with the kernel's conventions: causal aligned bottom-right (query i sees the first columns - queries + i
    + 1 keys), a 4-D mask sliced to the columns, K/V heads repeated for grouped queries."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    queries, columns = query.shape[2], key.shape[2]
    is_causal = False
    if mask is not None:
        mask = mask[..., :columns]
    elif causal and queries == columns:
        is_causal = True
    elif causal and queries > 1:
        mask = torch.ones(queries, columns, dtype=torch.bool).tril(columns - queries)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal)
    return out.transpose(1, 2)


def kernel(query, key, value, mask, causal):
    return invariant_attention(query, key, value, mask, query.shape[-1] ** -0.5, causal)


@contextlib.contextmanager
def on_threads(threads: int):
    """torch's intra-op threads for the block (the kernels' loops split among them), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_mask(generator, shape) -> torch.Tensor:
    """A bool mask (True: attend) with about a third masked and at least one allowed key per query."""
    mask = torch.rand(shape, generator=generator) < 0.65
    first = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return mask.scatter(-1, first.unsqueeze(-1), True)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' additive form of a bool mask: 0 where allowed, the dtype's min where masked."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


# name -> (rows, queries, columns, mask shape or None, mask form, causal)
VALUE_CASES = {
    "causal chunk over a prefix": (2, 9, 40, None, None, True),
    "causal whole sequence": (2, 70, 70, None, None, True),
    "one query, no mask": (3, 1, 77, None, None, False),
    "bool mask": (3, 6, 80, (3, 1, 6, 80), "bool", False),
    "additive mask": (3, 6, 80, (3, 1, 6, 80), "additive", False),
    "one mask for all rows": (3, 5, 33, (1, 1, 5, 33), "bool", False),
    "one mask row for all queries": (2, 4, 130, (2, 1, 1, 130), "additive", False),
    "mask wider than the keys": (2, 3, 20, (2, 1, 3, 25), "bool", False),
}


@pytest.mark.parametrize("head_dim", (8, 32, 48, 64))
@pytest.mark.parametrize("kv_heads", (2, 4), ids=("gqa group 2", "group 1"))
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_the_kernel_equals_sdpa(case, kv_heads, head_dim):
    rows, queries, columns, mask_shape, form, causal = VALUE_CASES[case]
    generator = torch.Generator().manual_seed(len(case) * 100 + kv_heads * 10 + head_dim)
    # transformers hands the query over as a transposed view: the kernel must read any strides
    query = torch.randn(rows, queries, 4, head_dim, generator=generator).transpose(1, 2)
    key, value = (torch.randn(rows, kv_heads, columns, head_dim, generator=generator) for _ in range(2))
    mask = None if mask_shape is None else random_mask(generator, mask_shape)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
        given = mask if form != "additive" else additive(mask, dtype)
        with torch.inference_mode():
            out = kernel(q, k, v, given, causal)
            want = sdpa(q.float(), k.float(), v.float(), mask, causal)
        assert out.dtype == dtype and out.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(out.float(), want, **BF16_TOLERANCE)


# ---- the kernel's invariance ------------------------------------------------------------------------------

ROWS, ROW, PAD, GAP, SPLIT, OTHER = 5, 2, 12, 9, 70, 40  # the batch layouts: see token_outputs
CHUNK = 7


def static_cache_columns(length: int) -> list[int]:
    """Where a static cache holds a sequence of `length` tokens: after PAD left-padding columns, with a gap of
    GAP dead columns after its first SPLIT tokens, ending at the last column (right-aligned)."""
    return [PAD + t if t < SPLIT else PAD + GAP + t for t in range(length)]


def over_prefix(attend, query, key, value, start: int, stop: int) -> torch.Tensor:
    """Queries start..stop-1 over keys 0..stop-1, causal, no mask: a decode step or a chunk after its prefix."""
    return attend(query[None, :, start:stop], key[None, :, :stop], value[None, :, :stop], None, True)[0]


def token_outputs(attend, query, key, value, generator) -> dict[str, torch.Tensor]:
    """One sequence (query [heads, L, D], key / value [kv_heads, L, D]) in each layout the engine runs:
    name -> that sequence's attention output per token, [L, heads, D]."""
    heads, length, dim = query.shape
    kv_heads, dtype = key.shape[0], query.dtype
    out = {"prefill": attend(query[None], key[None], value[None], None, True)[0]}
    out["decode"] = torch.cat([over_prefix(attend, query, key, value, i, i + 1) for i in range(length)])
    chunks = [(s, min(s + CHUNK, length)) for s in range(0, length, CHUNK)]
    out["chunks over a cached prefix"] = torch.cat(
        [over_prefix(attend, query, key, value, *c) for c in chunks]
    )

    # a static-cache batch: ROWS rows of other sequences (random keys and masks), ours in row ROW
    columns = static_cache_columns(length)
    width = columns[-1] + 1
    cache_k = torch.randn(ROWS, kv_heads, width, dim, generator=generator).to(dtype)
    cache_v = torch.randn(ROWS, kv_heads, width, dim, generator=generator).to(dtype)
    cache_k[ROW][:, columns], cache_v[ROW][:, columns] = key, value
    queries = torch.randn(ROWS, length, heads, dim, generator=generator).to(dtype)
    queries[ROW] = query.transpose(0, 1)
    allowed = random_mask(generator, (ROWS, 1, length, width))
    allowed[ROW] = False
    for i in range(length):
        allowed[ROW, 0, i, columns[: i + 1]] = True
    out["padded batch with a gap"] = attend(queries.transpose(1, 2), cache_k, cache_v, allowed, False)[ROW]
    steps = []
    for i in range(length):  # one query per row, an additive mask as transformers builds for decode
        step_mask = additive(allowed[:, :, i : i + 1], dtype)
        steps.append(attend(queries[:, i : i + 1].transpose(1, 2), cache_k, cache_v, step_mask, False)[ROW])
    out["decode over the padded cache"] = torch.cat(steps)

    # a packed row: another sequence of OTHER tokens, then ours; block-diagonal causal mask
    before = [torch.randn(t.shape[0], OTHER, dim, generator=generator).to(dtype) for t in (query, key, value)]
    packed = [torch.cat([b, t], dim=1)[None] for b, t in zip(before, (query, key, value), strict=True)]
    block = torch.ones(OTHER + length, OTHER + length, dtype=torch.bool).tril()
    block[OTHER:, :OTHER] = False
    out["packed after another sequence"] = attend(*packed, block[None, None], False)[0, OTHER:]
    return out


def sequence(generator, length, dtype, heads=4, kv_heads=2, dim=48):
    return [torch.randn(n, length, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads)]


def differing_layouts(outputs: dict[str, torch.Tensor]) -> list[str]:
    """Layouts whose output for some token differs from the whole prefill's, bitwise (with the tokens)."""
    whole = outputs["prefill"]
    failures = []
    for name, got in outputs.items():
        if not torch.equal(got, whole):
            tokens = (got != whole).flatten(1).any(1).nonzero().flatten().tolist()
            failures.append(f"{name} (tokens {tokens[:8]}{'...' if len(tokens) > 8 else ''})")
    return failures


# AVX-512 and AVX2 builds run the vector forms for head_dim a multiple of 16 (a prefill's many queries the tiled
# one, a decode's few the per-key one), the portable loop otherwise; (heads, kv_heads) = (6, 2): SmolLM2's
# group of 3.
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("length", (64, 150))
@pytest.mark.parametrize(
    "dim, heads", ((48, 4), (64, 6), (128, 4), (40, 4)), ids=("vector 48", "vector 64 group 3", "vector 128", "portable 40")
)
def test_a_tokens_attention_is_bitwise_the_same_in_every_layout(length, dtype, dim, heads):
    generator = torch.Generator().manual_seed(length)
    query, key, value = sequence(generator, length, dtype, heads=heads, dim=dim)
    with torch.inference_mode():
        outputs = token_outputs(kernel, query, key, value, generator)
        want = sdpa(query[None].float(), key[None].float(), value[None].float(), None, True)[0]
    assert differing_layouts(outputs) == []
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(outputs["prefill"].float(), want, **tolerance)


PACKED_LENGTHS = (5, 17, 3, 40, 30, 1, 60)  # 156 queries: chunks of 64 queries span several sequences


@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("dim", (64, 128, 40), ids=("vector 64", "vector 128", "portable 40"))
@pytest.mark.parametrize("layout", ("packed sequences", "random masks", "padded causal"))
def test_queries_run_together_get_each_querys_alone_result(layout, dim, dtype, threads):
    """Many queries in one call (the tiled form: each key list transposed once, queries taken in tiles,
    several lists per chunk of a packed row, a list per query under random masks) against each query in
    a call of its own (the per-key form), bitwise. On two threads the call's (row, K/V head, query chunk)
    items, of very unequal cost under a causal mask, are shared out by cost rather than in runs."""
    generator = torch.Generator().manual_seed(dim)
    total = sum(PACKED_LENGTHS)
    query = torch.randn(2, 6, total, dim, generator=generator).to(dtype)
    key, value = (torch.randn(2, 2, total, dim, generator=generator).to(dtype) for _ in range(2))
    if layout == "packed sequences":
        mask = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool).tril() for n in PACKED_LENGTHS))
        mask = mask.expand(2, 1, total, total).contiguous()
    elif layout == "random masks":
        mask = random_mask(generator, (2, 1, total, total))
    else:  # left padding of 9 and 30 columns, then causal; the padding's queries see no key (zeros out)
        mask = torch.ones(total, total, dtype=torch.bool).tril().expand(2, 1, total, total).clone()
        mask[0, :, :, :9], mask[1, :, :, :30] = False, False
    with torch.inference_mode():
        with on_threads(threads):
            together = kernel(query, key, value, mask, False)
        alone = torch.cat([kernel(query[:, :, i : i + 1], key, value, mask[:, :, i : i + 1], False) for i in range(total)], 1)
    assert together.shape == alone.shape
    if layout == "padded causal":
        assert not together[1, :30].any()
    differing = (together != alone).flatten(2).any(-1).nonzero().tolist()
    assert differing == [], f"(row, query) pairs that differ: {differing[:8]}"


# (shared length, rows in the group): whole blocks and a tail, one block exactly, under one block, a group of
# more rows than the kernel's query tile (16), and a group of one
SHARED_GROUPS = ((150, 3), (64, 2), (40, 2), (70, 17), (200, 1))


@dataclasses.dataclass
class CascadeCase:
    """SHARED_GROUPS' prompts as a cascade step's inputs: shared_key / shared_value [groups, 2, longest, dim],
    rows of 6 query heads with 23 own columns each (the first `row % gap` masked: rows of different
    lengths, right-aligned as in the static cache), and two rows without a group."""

    shared_key: torch.Tensor
    shared_value: torch.Tensor
    shared_length: torch.Tensor
    row_group: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def make(cls, dtype: torch.dtype, dim: int, seed: int, gap: int) -> CascadeCase:
        generator = torch.Generator().manual_seed(seed)
        heads, kv_heads, own = 6, 2, 23
        longest = max(length for length, _ in SHARED_GROUPS)
        shared_key, shared_value = (
            torch.randn(len(SHARED_GROUPS), kv_heads, longest, dim, generator=generator).to(dtype) for _ in range(2)
        )
        row_group = torch.tensor([g for g, (_, count) in enumerate(SHARED_GROUPS) for _ in range(count)] + [-1, -1])
        rows = row_group.numel()
        query = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
        key, value = (torch.randn(rows, kv_heads, own, dim, generator=generator).to(dtype) for _ in range(2))
        mask = torch.ones(rows, 1, 1, own, dtype=torch.bool)
        for row in range(rows):
            mask[row, :, :, : row % gap] = False
        shared_length = torch.tensor([length for length, _ in SHARED_GROUPS])
        return cls(shared_key, shared_value, shared_length, row_group, query, key, value, mask)

    @property
    def shared(self) -> tuple[torch.Tensor, ...]:
        """`invariant_attention_shared`'s shared_key, shared_value, shared_length and row_group."""
        return self.shared_key, self.shared_value, self.shared_length, self.row_group

    def row_holding_its_prompt(self, row: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Row `row`'s [prompt | own allowed keys] as one sequence (keys, values [kv_heads, L, dim]) and its
        prompt's length (0 without a group)."""
        group = int(self.row_group[row])
        length = int(self.shared_length[group]) if group >= 0 else 0
        columns = self.mask[row, 0, 0].nonzero().flatten()
        whole_key = torch.cat([self.shared_key[max(group, 0), :, :length], self.key[row][:, columns]], 1)
        whole_value = torch.cat([self.shared_value[max(group, 0), :, :length], self.value[row][:, columns]], 1)
        return whole_key, whole_value, length


@pytest.mark.parametrize("threads", (1, 2, 8))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("dim", (64, 128, 40), ids=("vector 64", "vector 128", "portable 40"))
def test_cascade_rows_get_the_bits_of_rows_holding_their_prompt(dtype, dim, threads):
    """Cascade decode (`invariant_attention_shared`): rows reading a group's shared prompt keys, then their
    own columns (right-aligned, of different lengths), several rows to a group. The oracle is each row
    holding [prompt | own keys] in its own cache row, in a call of its own, bitwise; rows without a group
    ride along, and one of them is checked against SDPA. In the vector form a group of 2+ rows takes its
    prompt's whole 64-key blocks together (as one tile; in fp32 on AVX2 its heads walk the keys in place,
    48 heads of 17 rows flushing their P.V at 32) and each row resumes from their softmax states (the 150-,
    64- and 70-key groups; the 40-key one has no whole block, the 200-key one a single row). On two
    threads the groups' tiles and the rows are shared out by their cost (groups of 2 to 17 rows); on
    eight, more than the 6 (group, K/V head) pairs, each group's rows are cut into two slices (1 + 2,
    1 + 1, 8 + 9 rows), each its own tile. The same with the tiles made once (`shared_prefix_tiles`, what
    a call's steps keep), bitwise; where the build reads tiles, tiles of other keys change the rows (control)."""
    load_invariant_kernels()
    case = CascadeCase.make(dtype, dim, seed=dim, gap=5)
    query, key, value, mask = case.query, case.key, case.value, case.mask
    scale = dim**-0.5
    with torch.inference_mode():
        tiles = shared_prefix_tiles(case.shared_key, case.shared_value, case.shared_length)  # a call's steps keep these
        with on_threads(threads):
            together = invariant_attention_shared(query, key, value, mask, scale, *case.shared)
            from_kept_tiles = invariant_attention_shared(query, key, value, mask, scale, *case.shared, tiles)
            if tiles.numel() > 0:  # control: the kept tiles are what is read (tiles of other keys change rows)
                others = shared_prefix_tiles(case.shared_key.flip(2), case.shared_value, case.shared_length)
                assert not torch.equal(invariant_attention_shared(query, key, value, mask, scale, *case.shared, others),
                                       together)  # fmt: skip
        assert torch.equal(from_kept_tiles, together)
        for row in range(query.shape[0]):
            whole_key, whole_value, _ = case.row_holding_its_prompt(row)
            alone = invariant_attention(query[row : row + 1], whole_key[None], whole_value[None], None, scale, False)
            assert torch.equal(together[row : row + 1], alone), f"row {row} (group {int(case.row_group[row])}) differs"
    want = sdpa(query[-1:].float(), key[-1:].float(), value[-1:].float(), mask[-1:], False)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(together[-1:].float(), want, **tolerance)


# Sliding windows against SHARED_GROUPS' prompts and rows of 18-23 own keys: one key; the own keys only (every
# shared key outside); 90 and 172, each covering one group's whole prompt for that group's shorter rows only
# (the 70- and 150-key groups: some rows read every shared key and take the group's tile of whole blocks, the
# others start inside the prompt) and ending inside the longer prompts; and one wider than every sequence.
WINDOWS = (1, 20, 90, 172, 400)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("dim", (64, 40), ids=("vector 64", "portable 40"))
def test_windowed_cascade_rows_get_the_bits_of_rows_holding_their_prompt(dtype, dim, window):
    """A sliding layer's cascade decode (`window`): each row's own mask narrowed to the window as the
    dispatcher narrows it (`within_window`), the kernel reading only the shared keys the window still
    covers. The oracle is each row holding [prompt | own keys] with the window over that whole sequence,
    in a call of its own, bitwise. Control: the same narrowed own masks without the window argument read
    every shared key, and differ from the oracle wherever the window ends inside a prompt."""
    from autobucket.engine.intercept.attention import within_window

    load_invariant_kernels()
    case = CascadeCase.make(dtype, dim, seed=dim + window, gap=6)
    query, key, value = case.query, case.key, case.value
    narrowed = within_window(case.mask, window, 1, key.shape[2], key.device)
    scale = dim**-0.5
    with torch.inference_mode():
        windowed = invariant_attention_shared(query, key, value, narrowed, scale, *case.shared, None, window)
        unwindowed = invariant_attention_shared(query, key, value, narrowed, scale, *case.shared)
        inside = 0  # rows whose window ends inside their prompt
        for row in range(query.shape[0]):
            whole_key, whole_value, length = case.row_holding_its_prompt(row)
            sequence = whole_key.shape[1]
            last_keys = torch.arange(sequence) >= sequence - window  # the window over the whole sequence
            alone = invariant_attention(query[row : row + 1], whole_key[None], whole_value[None],
                                        last_keys[None, None, None], scale, False)  # fmt: skip
            assert torch.equal(windowed[row : row + 1], alone), f"row {row} differs"
            if length > 0 and sequence > window:
                inside += 1
                assert not torch.equal(unwindowed[row : row + 1], alone), f"control: row {row} unchanged"
    assert inside > 0 or window == 400


def test_a_windowed_cascade_refuses_own_keys_past_the_window():
    load_invariant_kernels()
    query, key = torch.randn(1, 2, 1, 64), torch.randn(1, 1, 8, 64)
    shared = torch.randn(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match="allows 8 of its own keys, more than the window of 5"):
        invariant_attention_shared(query, key, key, None, 0.125, shared, shared, torch.tensor([4]),
                                   torch.tensor([0]), None, 5)  # fmt: skip


@functools.cache
def prefetch_builds() -> tuple:
    """The attention operator built twice beside the library, its decode prefetch fixed on and off
    (`AUTOBUCKET_DECODE_PREFETCH`, whatever this CPU would pick), each under its own operator namespace;
    compiled once per source and flags, like the library (torch's extension folder caches it)."""
    source = Path(library.__file__).parent / "csrc" / "invariant_attention.cpp"
    text = source.read_text()
    flags = [*library.BUILD_FLAGS, *library.PARALLEL_FLAGS, f"-I{source.parent}"]
    headers = sorted(path.read_text() for path in source.parent.glob("*.h"))
    digest = hashlib.sha256(f"{text}|{headers}|{flags}|{torch.__version__}|{library._cpu_flags()}".encode()).hexdigest()[:12]
    variants = {}
    for setting in (1, 0):
        namespace = f"autobucket_prefetch_{setting}"
        renamed = re.sub(r"TORCH_LIBRARY(_IMPL)?\(autobucket\b", rf"TORCH_LIBRARY\1({namespace}", text)
        variants[f"{namespace}.cpp"] = f"#define AUTOBUCKET_DECODE_PREFETCH {setting}\n{renamed}"
    name = f"autobucket_prefetch_variants_{digest}"
    from torch.utils import cpp_extension

    folder = library._copy_sources(Path(cpp_extension._get_build_directory(name, verbose=False)).parent / f"{name}_src",
                                   variants)  # fmt: skip
    cpp_extension.load(name=name, sources=[str(folder / file) for file in variants], extra_cflags=flags,
                       extra_ldflags=library.PARALLEL_FLAGS, is_python_module=False, verbose=False)  # fmt: skip
    return torch.ops.autobucket_prefetch_1.invariant_attention, torch.ops.autobucket_prefetch_0.invariant_attention


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_decode_with_and_without_its_kv_prefetch_gives_the_same_bits(dtype):
    """Decode prefetches K/V ahead (a few keys on Intel CPUs, a block on AMD ones with the eight-key
    scores) or not; the kernel built with it forced on and with it forced off runs here, on a static cache
    with rows of different lengths (a row's last keys and blocks are where the prefetch runs out): both
    give the library's bits, and match SDPA."""
    load_invariant_kernels()
    with_prefetch_op, without_op = prefetch_builds()
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(5, 6, 1, 64, generator=generator).to(dtype)
    key, value = (torch.randn(5, 2, 200, 64, generator=generator).to(dtype) for _ in range(2))
    mask = torch.zeros(5, 1, 1, 200, dtype=torch.bool)
    for row, length in enumerate((1, 3, 64, 131, 197)):
        mask[row, :, :, 200 - length :] = True
    allowed = allowed_for(mask, query.shape[0], key.shape[2])
    with torch.inference_mode():
        with_prefetch = with_prefetch_op(query, key, value, allowed, False, 64**-0.5)
        without = without_op(query, key, value, allowed, False, 64**-0.5)
        library_bits = kernel(query, key, value, mask, False)
    assert torch.equal(with_prefetch, without)
    assert torch.equal(with_prefetch, library_bits)
    want = sdpa(query.float(), key.float(), value.float(), mask, False)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(with_prefetch.float(), want, **tolerance)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_control_sdpa_on_the_same_layouts_differs_somewhere(dtype):
    generator = torch.Generator().manual_seed(150)
    query, key, value = sequence(generator, 150, dtype)
    with torch.inference_mode():
        assert differing_layouts(token_outputs(sdpa, query, key, value, generator))


# ---- what the kernel refuses --------------------------------------------------------------------------


def test_a_per_head_mask_is_refused():
    query, key, value = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    mask = torch.ones(2, 4, 3, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="shared by all heads.*kernels='torch'"):
        kernel(query, key, value, mask, False)


def test_an_additive_bias_is_refused():
    query, key, value = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    distance = torch.arange(6)[None, :] - torch.arange(6)[:, None]  # ALiBi: -slope * distance, causal
    bias = (0.5 * distance.clamp(max=0).float()).masked_fill(distance > 0, torch.finfo(torch.float32).min)
    with pytest.raises(ValueError, match="ALiBi.*kernels='torch'"):
        kernel(query, key, value, bias[None, None], False)


def test_softcapped_attention_is_refused():
    query, key = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="'softcap'.*kernels='torch'"):
        invariant_sdpa(torch.nn.Module(), query, key, key, None, softcap=30.0)


def test_a_cuda_model_without_triton_is_refused_naming_the_fix(tiny_models, monkeypatch):
    """A CUDA model runs the Triton kernel set: where triton is not installed, a model moved to a GPU
    between calls is refused before any forward, naming the install and kernels='torch' (no GPU here: the
    device the Rollout reads off the model is patched), and the Rollout serves again once the model is
    back on the CPU."""
    model = tiny_models("tiny-llama")
    rollout = Rollout(model, config=RolloutConfig(kernels="invariant", route="aligned"))
    sampling = SamplingConfig(max_new_tokens=2, eos_token_id=[])
    expected = rollout.generate([[3, 4]], sampling).tokens
    on_cpu = Rollout._model_fingerprint
    monkeypatch.setattr(Rollout, "_model_fingerprint", lambda self: (*on_cpu(self)[:1], torch.device("cuda", 0),
                                                                      *on_cpu(self)[2:]))  # fmt: skip
    monkeypatch.setattr("autobucket.engine.intercept.kernel_sets.triton_available", lambda: False)
    message = r"runs CUDA models on Triton kernels, and triton is not installed: pip install triton .*, or use RolloutConfig\(kernels='torch'\)"
    with pytest.raises(ValueError, match=message):
        rollout.generate([[3, 4]], sampling)
    monkeypatch.setattr(Rollout, "_model_fingerprint", on_cpu)
    assert rollout.generate([[3, 4]], sampling).tokens == expected


def test_a_model_loaded_with_eager_attention_is_refused(tiny_models):
    with pytest.raises(ValueError, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        Rollout(
            tiny_models("tiny-llama", attn_implementation="eager"), config=RolloutConfig(kernels="invariant")
        )


# ---- end to end -------------------------------------------------------------------------------------------

ROUTE_CONFIGS = {
    "ordinary": dict(route="ordinary"),
    "equal_width": dict(route="equal_width"),
    "aligned": dict(route="aligned"),
    "bucketed": dict(route="bucketed"),  # packed prefill (the planner's choice here)
    "bucketed padded": dict(route="bucketed", packing=False),
    "bucketed chunked": dict(route="bucketed", prefill_max_tokens=16),
    "auto": dict(route="auto"),
}
PROMPTS, BUDGET, ROWS_AT_ONCE = 32, 8, 8  # 8 rows at once: most prompts are admitted by refills
ALONE = (0, 13, PROMPTS - 1)  # the prompts also generated alone


def workload(arch: str) -> list[list[int]]:
    rng = random.Random(ARCHS.index(arch) + 90)
    return random_prompts([rng.randint(3, 90) for _ in range(PROMPTS)], seed=ARCHS.index(arch) + 90)


def sampled(seeds: list[int], n: int = 1) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=BUDGET,
        temperature=1.0,
        seed=seeds,
        logprobs=True,
        continuous_batch_size=ROWS_AT_ONCE,
        n=n,
    )


def alone_vs_batch(model, route: str, kernels: str, prompts, n: int = 1, alone=ALONE):
    """(the batch's (tokens, logprobs), [(prompt, whether its alone result equals its batch entry)])."""
    config = RolloutConfig(kernels=kernels, persist_costs=False, **ROUTE_CONFIGS[route])
    rollout = Rollout(model, config=config)
    batch = rollout.generate(prompts, sampled(list(range(len(prompts))), n))
    comparisons = []
    for k in alone:
        single = rollout.generate([prompts[k]], sampled([k], n))
        same = single.tokens[0] == batch.tokens[k] and single.logprobs[0] == batch.logprobs[k]
        comparisons.append((k, same))
    return (batch.tokens, batch.logprobs), comparisons


def invariance_failures(model, routes, prompts, n: int = 1, alone=ALONE) -> list[str]:
    """Every way the invariant kernels' results depend on the batch: a prompt alone vs in the batch, on
    each route, and each route's batch vs the first route's (bitwise tokens and logprobs)."""
    failures, first = [], None
    for route in routes:
        batch, comparisons = alone_vs_batch(model, route, "invariant", prompts, n, alone)
        failures += [
            f"{route}: prompt {k} alone differs from the batch" for k, same in comparisons if not same
        ]
        if first is None:
            first = (route, batch)
        elif batch != first[1]:
            failures.append(f"{route}'s batch differs from {first[0]}'s")
    return failures


@needs_onednn
@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHS)
def test_each_prompt_gets_its_alone_result_on_every_route(tiny_models, arch):
    assert invariance_failures(tiny_models(arch), ROUTE_CONFIGS, workload(arch)) == []


@needs_onednn
@pytest.mark.engine
@pytest.mark.parametrize("arch", ("tiny-qwen2", "tiny-opt"))
def test_n_samples_per_prompt_get_their_alone_results(tiny_models, arch):
    prompts = workload(arch)[:12]
    assert (
        invariance_failures(tiny_models(arch), ("bucketed", "aligned"), prompts, n=4, alone=(0, 5, 11)) == []
    )


@needs_onednn
def test_control_hf_kernels_depend_on_the_batch_somewhere(tiny_models):
    comparisons = [
        same
        for arch in ARCHS
        for route in ("aligned", "bucketed", "bucketed chunked")
        for _, same in alone_vs_batch(tiny_models(arch), route, "hf", workload(arch))[1]
    ]
    assert not all(comparisons), (
        f"all {len(comparisons)} hf comparisons were bitwise equal: the check is blind"
    )


@needs_onednn
def test_control_packed_linears_with_hf_attention_depend_on_the_batch(tiny_models, monkeypatch):
    """The attention kernel carries its share: the invariant linears over transformers' SDPA fail the check."""
    from autobucket.engine.batching.static_cache import StaticKVCache
    from autobucket.engine.intercept import kernel_sets as scope
    from autobucket.engine.intercept.attention import hf_sdpa

    monkeypatch.setattr(scope, "invariant_sdpa", lambda *args, **kwargs: hf_sdpa()(*args, **kwargs))
    # SDPA reads every cache column, owned or not, so it needs the zeroed cache the engine gives it wherever
    # it runs; the engine skips the zeroing for its own kernel, and this swap would feed SDPA whatever the
    # allocator left there (NaN logits in one CI run).
    allocate = StaticKVCache.__init__
    monkeypatch.setattr(StaticKVCache, "__init__", lambda self, *args, **kwargs: allocate(self, *args, **{**kwargs, "zero_filled": True}))
    assert invariance_failures(tiny_models("tiny-llama"), ("aligned", "bucketed"), workload("tiny-llama"))


@pytest.mark.engine
@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="no oneDNN bf16 linear on this CPU")
@pytest.mark.parametrize("arch", ("tiny-llama", "tiny-gpt2"))
def test_bf16_models_get_their_alone_results(tiny_models, arch):
    model = copy.deepcopy(tiny_models(arch)).to(torch.bfloat16)  # the session's fp32 model stays fp32
    assert invariance_failures(model, ("auto", "bucketed"), workload(arch)) == []


# ---- the default kernels' decode attention ------------------------------------------------------------------


def test_default_kernels_decode_on_the_engine_kernel(tiny_models, monkeypatch):
    """`op_backends={"decode_attention": "cpu"}`: every eager decode step's attention runs the engine's kernel (prefill stays on
    transformers' SDPA), and the tokens are single-request `generate`'s (the oracle suite checks every
    architecture and route)."""
    from oracles import oracle_generate

    from autobucket.engine.kernels import invariant_attention as module

    calls = {"decode": 0, "other": 0}
    original = module.invariant_attention

    def counting(query, *args, **kwargs):
        calls["decode" if query.shape[2] == 1 else "other"] += 1
        return original(query, *args, **kwargs)

    monkeypatch.setattr(module, "invariant_attention", counting)
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([5, 19, 11], seed=8)
    config = RolloutConfig(route="aligned", kernels="torch", op_backends={"decode_attention": "cpu"})
    result = Rollout(model, config=config).generate(
        prompts, SamplingConfig(max_new_tokens=6, eos_token_id=[])
    )
    layers = model.config.num_hidden_layers
    assert calls["decode"] == 5 * layers and calls["other"] == 0  # 5 decode steps after the prefill's token
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == oracle_generate(model, prompt, 6, eos_token_id=[])[0]


def test_default_decode_attention_falls_back_to_sdpa_where_the_kernel_cannot_take_the_call():
    """A per-head mask, softcapping or sinks go to transformers' own SDPA: bitwise its result."""
    from autobucket.engine.intercept.attention import hf_sdpa
    from autobucket.engine.kernels.invariant_attention import decode_sdpa

    class Layer(torch.nn.Module):
        is_causal, layer_idx = True, 0

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, 4, 1, 16, generator=generator)
    key, value = (torch.randn(3, 2, 20, 16, generator=generator) for _ in range(2))
    key, value = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)  # SDPA's own layout here
    per_head = random_mask(generator, (3, 4, 1, 20))
    layer = Layer()
    with torch.inference_mode():
        ours, _ = decode_sdpa(layer, query, key, value, per_head)
        theirs, _ = hf_sdpa()(layer, query, key, value, per_head)
        assert torch.equal(ours, theirs)
        on_kernel, _ = decode_sdpa(layer, query, key, value, per_head[:, :1])
        torch.testing.assert_close(on_kernel, hf_sdpa()(layer, query, key, value, per_head[:, :1])[0])


def test_the_avx2_build_gives_the_libraries_bits(tmp_path):
    """The vector form is written once over 16-lane vectors (csrc/lanes.h: one AVX-512 register or two
    AVX2 ones) with lane-by-lane IEEE operations and fixed trees, so an AVX2 machine and an AVX-512 one
    give a token the same attention output, and draw the same sample from the same logits. Builds the
    attention's and the sampler's AVX2 form under its own library name (~40 s once, then cached) and
    compares decode (the per-key form) and prefill (the tiled form) outputs, fp32 and bf16, and sampled
    tokens and logprobs, with the library's: on an AVX-512 CPU that is the cross-width check; on an AVX2
    CPU the library is that form, and the comparison only checks this test's own plumbing."""
    import hashlib
    from pathlib import Path

    from torch.utils import cpp_extension

    from autobucket.engine.intercept.attention import within_window
    from autobucket.engine.kernels import library as module

    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    load_invariant_kernels()
    csrc = Path(module.__file__).parent / "csrc"
    namespace = "autobucket_avx2_attention_check"
    texts = []
    for name in ("invariant_attention.cpp", "sample_inverse_cdf.cpp"):
        source = (csrc / name).read_text()
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
            source = source.replace(f"{macro}(autobucket,", f"{macro}({namespace},")
        (tmp_path / name).write_text(source)
        texts.append(source)
    for header in module._HEADERS:
        (tmp_path / header.name).write_text(header.read_text())
        texts.append(header.read_text())
    flags = ["-O3", "-march=native", "-mno-avx512f", "-fno-fast-math", "-ffp-contract=off"]
    digest = hashlib.sha256(f"{'|'.join(texts)}|{flags}|{torch.__version__}".encode()).hexdigest()[:12]
    if not hasattr(torch.ops, namespace) or not hasattr(getattr(torch.ops, namespace), "invariant_attention"):
        sources = [str(tmp_path / name) for name in ("invariant_attention.cpp", "sample_inverse_cdf.cpp")]
        cpp_extension.load(name=f"{namespace}_{digest}", sources=sources, extra_cflags=flags, is_python_module=False,
                           verbose=False)  # fmt: skip
    other = getattr(torch.ops, namespace)
    assert other.vector_bits() == 256
    generator = torch.Generator().manual_seed(3)
    empty = torch.empty(0, dtype=torch.bool)
    for dtype in (torch.float32, torch.bfloat16):
        for queries, dim in ((1, 64), (1, 128), (150, 64), (150, 48)):  # decode and prefill, two head sizes
            query = torch.randn(2, 6, queries, dim, generator=generator).to(dtype)
            key, value = (torch.randn(2, 2, 150, dim, generator=generator).to(dtype) for _ in range(2))
            with torch.inference_mode():
                ours = torch.ops.autobucket.invariant_attention(query, key, value, empty, True, dim**-0.5)
                theirs = other.invariant_attention(query, key, value, empty, True, dim**-0.5)
            assert torch.equal(ours, theirs), (dtype, queries, dim)
        # a windowed cascade step: AVX2 walks an fp32 prefix's whole blocks in place, AVX-512 in tiles
        case = CascadeCase.make(dtype, 64, seed=5, gap=6)
        narrowed = within_window(case.mask, 90, 1, case.key.shape[2], case.key.device)
        for window in (0, 90):
            mask = narrowed if window else case.mask
            with torch.inference_mode():
                ours = torch.ops.autobucket.invariant_attention_shared(
                    case.query, case.key, case.value, mask[:, 0], 0.125, *case.shared, None, window)
                theirs = other.invariant_attention_shared(
                    case.query, case.key, case.value, mask[:, 0], 0.125, *case.shared, None, window)
            assert torch.equal(ours, theirs), (dtype, "cascade", window)
    scores = torch.randn(64, 32000, generator=generator) * 3
    scores[::5, 20000:] = float("-inf")
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    ours = torch.ops.autobucket.sample_inverse_cdf(scores, uniforms)
    theirs = other.sample_inverse_cdf(scores, uniforms)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
