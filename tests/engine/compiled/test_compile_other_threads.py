"""Another thread's eager forwards while this process compiles: they keep their own state.

Torch holds `torch.compiler.is_compiling()` True for every thread through a compile session. Oracles:
the library variables behave per thread during a session as outside one (`TraceLocalVariable` against
the libraries' own `CompileableContextVar`s, which leak between threads there: the negative control); a
trainer thread's `autobucket.invariant` forward during a session is bitwise its forward outside one
(the unscoped forward differs: the control); and the sequence that once crashed — a thread's forwards
interleaved with a compiled `generate`, then `generate` with route auto — pinned with events so that
the old interleaving happens every time: every forward and both calls equal their single-thread
oracles (on the libraries' variables the other thread's forward and the auto call raise
"'_contextvars.Token' object is not iterable")."""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

import pytest
import torch
from kernelized_models import kernelized_attention_model
from oracles import oracle_batch
from torch.overrides import TorchFunctionMode
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig, invariant
from autobucket.engine.compiled.compiled_decode import CompiledDecode
from autobucket.engine.compiled.trace_local_variables import (
    LIBRARY_VARIABLES,
    TraceLocalVariable,
    is_racing_kind,
    make_trace_local,
)
from autobucket.engine.kernels.library import kernel_library_builds

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTHS = [7, 23, 12, 30]  # 4 rows, longest + budget < 128 columns: one decode graph
BUDGET = 8
WAIT_S = 600  # a compile on a busy CPU; a wait that runs out fails the test instead of hanging it


def _session():
    """torch's compile-session flag, as dynamo holds it around every compile (absent: nothing to test)."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is None:
        pytest.skip("this torch has no compile-session flag")
    return session


def _library_kind(index: int):
    """A fresh instance of the library's `CompileableContextVar` class at `LIBRARY_VARIABLES[index]`."""
    module_name, attribute = LIBRARY_VARIABLES[index]
    current = getattr(pytest.importorskip(module_name), attribute)
    current = current.replaced if isinstance(current, TraceLocalVariable) else current
    return type(current)(f"test_{attribute}")


def _in_other_thread(function):
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT_S)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _other_thread_sees(variable) -> tuple:
    """What a thread sees of `variable` while another thread's forward holds a value in it, during a
    compile session: (the other thread's own value, this thread's value, after the other's reset)."""
    held, release = threading.Event(), threading.Event()

    def other_forward():
        token = variable.set({"other": 1})
        held.set()
        release.wait(WAIT_S)
        own = variable.get()
        variable.reset(token)
        return own

    with _session()():
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.setdefault("own", other_forward()))
        thread.start()
        assert held.wait(WAIT_S)
        seen_here = variable.get()
        release.set()
        thread.join(WAIT_S)
    return outcome["own"], seen_here, variable.get()


@pytest.mark.parametrize("index", range(len(LIBRARY_VARIABLES)), ids=[name for _, name in LIBRARY_VARIABLES])
def test_a_trace_local_variable_stays_per_thread_during_a_compile_session(index):
    kind = _library_kind(index)
    assert _other_thread_sees(TraceLocalVariable(kind)) == ({"other": 1}, None, None)
    # Control: the library's own variable goes process-wide during the session; this thread sees the other's.
    assert _other_thread_sees(kind)[1] == {"other": 1}


def test_tokens_taken_before_the_swap_reset_through_the_new_variable():
    """A forward that set the library's variable before `make_trace_local` and resets after it."""
    kind = _library_kind(0)  # the kernels hub's
    token = kind.set({"before": 1})
    variable = TraceLocalVariable(kind)
    assert variable.get() == {"before": 1}
    variable.reset(token)
    assert variable.get() is None and kind.get() is None
    with _session()():
        handed_out = kind.set({"global": 1})  # the library's global mode: not a ContextVar token
    variable.reset(handed_out)
    assert kind.get() is None


def test_make_trace_local_replaces_each_imported_library_variable_once():
    present = [(m, a) for m, a in LIBRARY_VARIABLES if pytest.importorskip(m) is not None]
    make_trace_local()
    replaced = [getattr(pytest.importorskip(m), a) for m, a in present]
    assert all(isinstance(v, TraceLocalVariable) and not is_racing_kind(v) for v in replaced)
    assert all(is_racing_kind(v.replaced) for v in replaced)
    make_trace_local()
    assert [getattr(pytest.importorskip(m), a) for m, a in present] == replaced


@pytest.mark.engine
def test_another_threads_invariant_forward_during_a_compile_session_is_its_forward_outside(tiny_models):
    if not kernel_library_builds():
        pytest.skip("no C++ toolchain: the kernel library is not built here")
    model = tiny_models("tiny-qwen2")
    ids = torch.tensor([random_prompts([19], seed=4)[0]])

    def forward(scoped: bool) -> torch.Tensor:
        with torch.no_grad(), invariant(model) if scoped else nullcontext():
            return model(input_ids=ids).logits

    outside = _in_other_thread(lambda: forward(True))
    with _session()():
        during = _in_other_thread(lambda: forward(True))
    assert torch.equal(during, outside)
    assert not torch.equal(forward(False), outside), "the scope changed nothing: the test could not fail"


# ---- the sequence: a thread's forwards while generate compiles, then route auto ----------------------


class PauseAtFirstLinear(TorchFunctionMode):
    """This thread's forward inside the mode stops at its first linear (inside layer 0's attention, after
    the kernels hub's attention forward set its variable) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True
        self.reached, self.release = threading.Event(), threading.Event()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.armed and getattr(func, "__name__", "") == "linear":
            self.armed = False
            self.reached.set()
            self.release.wait(WAIT_S)
        return func(*args, **(kwargs or {}))


class OtherThread:
    """A trainer thread running two forwards of the model; each starts when asked and pauses at its
    first linear until released."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor) -> None:
        self.model, self.ids = model, ids
        self.start = [threading.Event(), threading.Event()]
        self.pauses = [PauseAtFirstLinear(), PauseAtFirstLinear()]
        self.logits: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            for start, pause in zip(self.start, self.pauses, strict=True):
                start.wait(WAIT_S)
                with torch.no_grad(), pause:
                    self.logits.append(self.model(input_ids=self.ids).logits)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            self.error = error
        finally:
            for pause in self.pauses:  # no one waits for a pause that will not come
                pause.reached.set()

    def forward_until_paused(self, index: int) -> None:
        self.start[index].set()
        assert self.pauses[index].reached.wait(WAIT_S), "the other thread's forward did not reach its pause"

    def finish(self) -> None:
        for pause in self.pauses:
            pause.release.set()
        self.thread.join(WAIT_S)


@contextmanager
def interleaved_with(other: OtherThread, monkeypatch):
    """The interleaving pinned. During the engine's first compile session the other thread's first forward
    sets the hub's variable (process-wide, since the session flag is up) and holds it while the trace reads
    it; it finishes as the session ends, and its second forward sets the variable again (a ContextVar
    token now) and holds it across the first compiled step, whose graph replays the hub's
    `uses_global_var = True` that its trace made; then the second forward resets its token."""
    original_session, original_step = torch.compiler._compile_session_context, CompiledDecode.step
    sessions = []

    @contextmanager
    def session():
        sessions.append(1)
        with original_session():
            if len(sessions) == 1:
                other.forward_until_paused(0)
            yield
        if len(sessions) == 1:
            other.pauses[0].release.set()
            other.forward_until_paused(1)

    def step(self, inputs):
        logits = original_step(self, inputs)
        if len(sessions) == 1 and not other.pauses[1].release.is_set():
            other.finish()
        return logits

    monkeypatch.setattr(torch.compiler, "_compile_session_context", session)
    monkeypatch.setattr(CompiledDecode, "step", step)
    try:
        yield
    finally:
        other.finish()


@pytest.mark.engine
def test_another_threads_forwards_during_a_compiled_generate_then_route_auto(monkeypatch):
    _session()
    model = kernelized_attention_model(seed=21)
    prompts = random_prompts(LENGTHS, seed=3)
    expected, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    ids = torch.tensor([random_prompts([11], seed=8)[0]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=len(LENGTHS), eos_token_id=[])

    other = OtherThread(model, ids)
    with interleaved_with(other, monkeypatch):
        compiled = Rollout(model, config=RolloutConfig(route="aligned", compile=True)).generate(prompts, sampling)
    auto = Rollout(model, config=RolloutConfig(route="auto", persist_costs=False)).generate(prompts, sampling)
    assert other.error is None, f"the other thread's forward raised {other.error!r}"

    assert len(other.logits) == 2 and all(torch.equal(logits, plain) for logits in other.logits)
    assert compiled.profile.compiled_steps > 0, f"nothing ran compiled: {compiled.profile.compile_fallback}"
    assert compiled.tokens == expected
    assert auto.tokens == expected
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)  # this thread's forwards after it all
