"""The engine's kernels on torch's threads: the library is built so that `at::parallel_for` splits its loops
(ATen inlines it as an OpenMP loop, which runs on one thread in a build without OpenMP), on the one OpenMP
runtime torch loaded; and a rollout whose kernels split their loops over two threads gives bitwise the
tokens and logprobs of the same rollout on one thread (linears split by panels, attention by rows and K/V
heads, the cascade's shared blocks by groups). Oracle: the one-thread rollout; the engine's own invariance
claim is that threads change speed, never a value."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels.library import kernel_library_builds

pytestmark = [pytest.mark.engine]


@pytest.fixture
def library():
    if not kernel_library_builds():
        pytest.skip("no C++ toolchain: the kernel library is not built here")


def openmp_runtimes() -> set[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}


def test_the_library_splits_its_loops_on_torchs_openmp_runtime(library):
    assert torch.ops.autobucket.splits_among_threads()
    assert len(openmp_runtimes()) == 1, openmp_runtimes()  # torch's: the library shares it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.usefixtures("always_share")  # cascade decode for every n > 1 prompt
def test_a_rollout_on_two_threads_is_bitwise_the_one_thread_rollout(library, dtype, tiny_models, monkeypatch):
    model = copy.deepcopy(tiny_models("tiny-qwen2")).to(dtype)  # the shared fixture stays fp32
    prompts = random_prompts([70, 130, 9, 200, 33], seed=8)  # shared prompts with whole 64-key blocks
    sampling = SamplingConfig(max_new_tokens=6, eos_token_id=[], n=3, temperature=1.0, seed=5, logprobs=True,
                              continuous_batch_size=8)  # fmt: skip
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rollout = Rollout(model, config=RolloutConfig(kernels="invariant", persist_costs=False, compile=False))
            results.append(rollout.generate(prompts, sampling))
    finally:
        torch.set_num_threads(before)
    one, two = results
    assert one.profile.shared_kv_rows > 0  # the cascade ran
    assert one.tokens == two.tokens and one.logprobs == two.logprobs


def test_a_toolchain_without_openmp_gets_a_one_thread_build_and_a_warning(monkeypatch):
    """The build with OpenMP fails (no libgomp to link): the library is built without it, warned once;
    when that fails too, the error names the fix. (The builds themselves are stubbed: the library is
    already loaded in this process.)"""
    from autobucket.engine.kernels import library

    builds = []

    def build(parallel_flags):
        builds.append(list(parallel_flags))
        if parallel_flags:
            raise RuntimeError("Error building extension\n/usr/bin/ld: cannot find -lgomp")

    monkeypatch.setattr(library, "_build_and_load", build)
    with pytest.warns(RuntimeWarning, match=r"did not build with OpenMP \(/usr/bin/ld: cannot find -lgomp\).*one thread"):
        library.load_invariant_kernels.__wrapped__()
    assert builds == [library.PARALLEL_FLAGS, []]

    def never(parallel_flags):
        raise OSError("ninja not found")

    monkeypatch.setattr(library, "_build_and_load", never)
    with pytest.raises(ValueError, match=r"build failed \(OSError: ninja not found\); install g\+\+ and ninja"):
        library.load_invariant_kernels.__wrapped__()


def test_one_build_whatever_path_the_package_is_loaded_from(monkeypatch, tmp_path):
    """Two installs of the same sources (a second checkout, a symlinked venv) hand the build the same
    source paths, so ninja sees one build and does not rebuild in turn. Oracle: the arguments the build
    receives from each install; a copy whose text differs gets another build."""
    from torch.utils import cpp_extension

    from autobucket.engine.kernels import library

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))

    def install(folder: Path, edit: str = "") -> None:
        for path in (*library._SOURCES, *library._HEADERS):
            (folder / path.name).parent.mkdir(parents=True, exist_ok=True)
            (folder / path.name).write_text(path.read_text() + edit)
        monkeypatch.setattr(library, "_SOURCES", [folder / path.name for path in library._SOURCES])
        monkeypatch.setattr(library, "_HEADERS", [folder / path.name for path in library._HEADERS])
        library._build_and_load(library.PARALLEL_FLAGS)

    originals = (list(library._SOURCES), list(library._HEADERS))
    install(tmp_path / "checkout-a")
    monkeypatch.setattr(library, "_SOURCES", originals[0])
    monkeypatch.setattr(library, "_HEADERS", originals[1])
    install(tmp_path / "checkout-b")
    first, second = calls
    assert first["name"] == second["name"] and first["sources"] == second["sources"]
    assert all(str(tmp_path / "extensions") in source for source in first["sources"])
    assert Path(first["sources"][0]).read_text() == originals[0][0].read_text()  # the copy builds the same text
    monkeypatch.setattr(library, "_SOURCES", originals[0])
    monkeypatch.setattr(library, "_HEADERS", originals[1])
    install(tmp_path / "checkout-c", edit="\n// edited\n")
    assert calls[2]["name"] != first["name"] and calls[2]["sources"] != first["sources"]
