"""Online-cost persistence: one writer per fingerprint (rank 0 of torch.distributed when it
is initialised, else `$RANK`), an unwritable cache folder never fails a call (one warning; the tokens are
still the oracle's), and `RolloutConfig(persist_costs=False)` neither reads nor writes the cache.

Tests run as root, where a chmod'ed folder stays writable: unwritable here is a cache root that is a file,
or a rename that raises PermissionError."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from oracles import assert_matches_oracle, oracle_batch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.costs.store import (
    RANK_ENV,
    entry_path,
    load_entry,
    persist_entry,
    save_entry,
    store_metadata,
    writer_rank,
)
from autobucket.models import CACHE_DIR_ENV

pytestmark = pytest.mark.usefixtures("single_thread")  # the fingerprint holds the thread count
PROMPTS = random_prompts([5, 40, 7, 12], seed=2)
SAMPLING = SamplingConfig(max_new_tokens=4, continuous_batch_size=4)
NOT_SAVED = "learned costs are kept in memory only"


@pytest.fixture
def model(tiny_models):
    return tiny_models("tiny-qwen2")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(RANK_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def seeded(model, cache) -> Path:
    """An entry an earlier process learned for `model` on the model's own ops (`kernels="torch"`, which the
    tests here pin): Auto starts from it (no probe)."""
    return save_entry(store_metadata(model), CostCoefficients(), [], "online")


def generate_exactly(model, config: RolloutConfig, calls: int = 1):
    """`calls` generate calls of one Rollout; each must give the single-request oracle's tokens."""
    rollout = Rollout(model, config=config)
    results = [rollout.generate(PROMPTS, SAMPLING) for _ in range(calls)]
    for result in results:
        assert_matches_oracle(result, *oracle_batch(model, PROMPTS, SAMPLING.max_new_tokens))
    return results


def not_saved_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if NOT_SAVED in str(w.message)]


@pytest.mark.parametrize("rank", [None, "0", "1"])
def test_rank_zero_writes_and_the_other_ranks_only_read(model, seeded, monkeypatch, rank):
    if rank is not None:
        monkeypatch.setenv(RANK_ENV, rank)
    before = seeded.read_bytes()
    (result,) = generate_exactly(model, RolloutConfig(route="auto", kernels="torch"))
    assert result.profile.costs_source == "stored"  # every rank starts from the entry
    written = seeded.read_bytes() != before
    assert written == (rank != "1"), f"rank {rank}: written={written}"


def test_torch_distributed_rank_overrides_the_environment(model, cache, monkeypatch, tmp_path):
    import torch.distributed as dist

    metadata = store_metadata(model)
    monkeypatch.setenv(RANK_ENV, "1")  # a stale launcher variable: the process group's rank wins
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        assert writer_rank() == 0
        assert persist_entry(metadata, CostCoefficients(), [], "online").is_file()
    finally:
        dist.destroy_process_group()
    assert writer_rank() == 1
    monkeypatch.setenv(RANK_ENV, "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    path = persist_entry(metadata, CostCoefficients(fixed_ms=1.0), [], "online")
    assert writer_rank() == 3 and path is None
    assert load_entry(metadata)[0] == CostCoefficients()  # rank 3 did not overwrite rank 0's entry


def test_a_failing_rename_warns_once_and_the_calls_go_on(model, seeded, monkeypatch):
    before = seeded.read_bytes()

    def refuse(self, target):
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(Path, "replace", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_exactly(model, RolloutConfig(route="auto", kernels="torch"), calls=2)
        generate_exactly(model, RolloutConfig(route="auto", kernels="torch"))  # another Rollout, same entry: no new warning
    (message,) = not_saved_warnings(caught)
    assert "Permission denied" in message and str(seeded) in message and "\n" not in message
    assert seeded.read_bytes() == before
    assert sorted(p.name for p in seeded.parent.iterdir()) == [seeded.name]  # no temporary file left


def test_a_cache_root_that_is_a_file_holds_no_entry_and_fails_no_call(model, tmp_path, monkeypatch):
    root = tmp_path / "not-a-folder"
    root.write_text("a file where the cache folder should be\n")
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (first, second) = generate_exactly(model, RolloutConfig(route="auto", kernels="torch"), calls=2)
    assert (first.profile.costs_source, second.profile.costs_source) == ("probe", "online")
    (message,) = not_saved_warnings(caught)
    assert str(root) in message and "Not a directory" in message
    assert root.read_text() == "a file where the cache folder should be\n"


def test_persist_costs_false_neither_reads_nor_writes(model, seeded):
    before = seeded.read_bytes()
    results = generate_exactly(model, RolloutConfig(route="auto", persist_costs=False, kernels="torch"), calls=2)
    # Read, it would say "stored" (the rank-0 test above); written, the bytes would change.
    assert [r.profile.costs_source for r in results] == ["probe", "online"]
    assert seeded.read_bytes() == before
    assert sorted(p.name for p in seeded.parent.iterdir()) == [seeded.name]


# ------------------------------------------------------------------------------------ what an entry is keyed on
XEON = "Intel(R) Xeon(R) Processor family 6 model 143 avx2 avx512f avx512_bf16 amx_tile"


def test_each_kernel_set_learns_in_its_own_entry(model, seeded):
    """The seeded entry was learned with the model's own ops; the invariant kernels' calls cost up to 2x
    less (AMD EPYC), so they start from a probe of their own and keep their own entry."""
    (own_ops,) = generate_exactly(model, RolloutConfig(route="auto", kernels="torch"))
    (invariant,) = generate_exactly(model, RolloutConfig(route="auto", kernels="invariant"))
    assert (own_ops.profile.costs_source, invariant.profile.costs_source) == ("stored", "probe")
    assert len(list(seeded.parent.iterdir())) == 2
    (again,) = generate_exactly(model, RolloutConfig(route="auto", kernels="invariant"))
    assert again.profile.costs_source == "stored"


def test_negative_control_a_store_keyed_without_the_kernels_serves_the_other_kernels_costs(model, seeded, monkeypatch):
    import autobucket.costs.source as cost_source

    monkeypatch.setattr(cost_source, "store_metadata", lambda model, kernels: store_metadata(model))
    (invariant,) = generate_exactly(model, RolloutConfig(route="auto", kernels="invariant"))
    assert invariant.profile.costs_source == "stored"  # the model's own ops' costs, planning the invariant ones


def test_an_entry_learned_on_another_cpu_kind_is_not_used(model, cache, monkeypatch):
    import autobucket.costs.store as store

    with monkeypatch.context() as on_a_xeon:
        on_a_xeon.setattr(store, "host_cpu", lambda: XEON)
        assert store_metadata(model)["cpu"] == XEON
        save_entry(store_metadata(model), CostCoefficients(), [], "online")
    assert store_metadata(model)["cpu"] != XEON
    (result,) = generate_exactly(model, RolloutConfig(route="auto", kernels="torch"))
    assert result.profile.costs_source == "probe"
    assert len(list((cache / "online-costs").iterdir())) == 2  # the Xeon's entry is left as it was


def test_host_cpu_names_the_kind_not_only_the_model_name():
    from autobucket.costs.calibration_file import host_cpu

    described = host_cpu()
    if Path("/proc/cpuinfo").is_file():  # read here independently: the first processor's fields
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
        assert described.startswith(f"{field['model name']} family {field['cpu family']} model {field['model']}")
        assert ("avx512f" in described) == ("avx512f" in field["flags"].split())
    assert described == host_cpu()


def test_a_stale_entry_is_read_and_reported_once_by_a_fixed_route_not_every_call(model, cache, monkeypatch):
    """An entry an older autobucket learned (same key, another source fingerprint) is ignored; a fixed route
    never probes or rewrites it, and used to re-read it and warn on every call (twice a call)."""
    import autobucket.costs.source as cost_source

    older = {**store_metadata(model), "source_fingerprint": "an older autobucket"}
    stale = save_entry(older, CostCoefficients(), [], "online")
    assert stale == entry_path(store_metadata(model))  # the same key: this entry is what a new call finds
    reads = []
    monkeypatch.setattr(cost_source, "load_entry", lambda metadata: reads.append(metadata) or load_entry(metadata))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_exactly(model, RolloutConfig(route="aligned", kernels="torch"), calls=3)
    assert len(reads) == 1
    assert [str(w.message) for w in caught if "ignoring the learned cost entry" in str(w.message)] == [
        f"ignoring the learned cost entry {str(stale)!r}: stale or for another setup (source_fingerprint "
        f"'an older autobucket' != {store_metadata(model)['source_fingerprint']!r})"
    ]
