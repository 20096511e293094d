"""Session-wide fixtures: the tiny models built once per session, the shared-state guard, an isolated
cost cache, torch threads per worker and the forced compiled decode.

Helpers that tests import live in plain modules beside this file (`oracles`, `workloads`,
`byte_tokenizer`, `shared_state`, `windowed_models`), never in a conftest: pytest imports every
conftest.py of a folder without `__init__.py` under the one name `conftest`, so `from conftest import`
would read whichever folder's conftest was imported last. Fixtures used by one folder only live in
that folder's conftest.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The Triton kernels' tests run them on CPU tensors through Triton's interpreter, which triton takes from the
# environment when it is first imported: set before any test module (or torch's inductor) imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# The helper modules beside this file import from a test in any folder, whatever import mode or
# working directory pytest runs with.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from oracles import forget_all_oracles  # noqa: E402
from shared_state import TinyModels, changed_process_state, torch_process_state  # noqa: E402

_TINY_MODELS = TinyModels()


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """Every test runs with AUTOBUCKET_CACHE_DIR in a temporary folder, so learned costs never touch the
    real cache; the converted SmolLM2 (a slow one-time conversion) is linked in from the real cache."""
    import os
    from pathlib import Path

    from autobucket.models import CACHE_DIR_ENV, smollm2_cache_dir

    real = smollm2_cache_dir().parent
    root = tmp_path_factory.mktemp("autobucket-cache")
    if real.exists():
        (root / real.name).symlink_to(real, target_is_directory=True)
    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(root)
    yield Path(root)
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """Under pytest-xdist (`make test`: one worker per core), each worker's torch gets its share of the
    cores: torch's default (every core) in every worker would run workers x cores threads, and OpenMP
    threads waiting for a busy core are what made tests ~10x slower on a loaded machine (single_thread).
    Tests that need more threads set them and restore them."""
    import os

    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    before = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    return _TINY_MODELS


@pytest.fixture(autouse=True)
def shared_state_unchanged(request):
    """Fails the test that changed a shared tiny model (the next test would compare against it) or
    left a process-wide torch setting changed."""
    state = torch_process_state()
    yield
    leaked = changed_process_state(state, torch_process_state())
    if leaked:
        pytest.fail(f"{request.node.nodeid} left torch settings changed: {'; '.join(leaked)}; restore them")
    changed = _TINY_MODELS.changed_models()
    if changed:
        _TINY_MODELS.forget()  # rebuilt on next use, so one culprit fails once, not every later test
        forget_all_oracles()
        pytest.fail(f"{request.node.nodeid} changed shared tiny models: {'; '.join(changed)}; work on a copy.deepcopy")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the tiny models' modules (restored afterwards).

    A 64-wide model gains nothing from a second thread, and when the 2-core machine is busy, OpenMP
    workers waiting for a core made these tests ~10x slower in wall time.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


COMPILE_ENV = "AUTOBUCKET_TEST_COMPILE"  # "1": RolloutConfig's default becomes compile=True


@pytest.fixture(scope="session", autouse=True)
def forced_compile():
    """With AUTOBUCKET_TEST_COMPILE=1 (`make test-compile`), the whole suite runs the compiled decode step.

    Only the default changes (the dataclass __init__'s default value), so a test that passes
    compile=False explicitly (the controls that break an eager-only code path) keeps its meaning."""
    import inspect
    import os

    if os.environ.get(COMPILE_ENV) != "1":
        yield False
        return
    from autobucket import RolloutConfig

    init = RolloutConfig.__init__
    names = list(inspect.signature(init).parameters)[1:]
    original = init.__defaults__
    index = names.index("compile") - (len(names) - len(original))
    init.__defaults__ = original[:index] + (True,) + original[index + 1 :]
    yield True
    init.__defaults__ = original
