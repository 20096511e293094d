"""How the engine's forwards reach its linears and eval dropout (`function_routes.py`): `F.linear` and
dropout replaced by routers only while a scope is open, routing only the scope's own thread; `Conv1D`
addmm calls through a mode for models that have such layers (`torch.addmm` itself never replaced).

Oracles: the builtins themselves (identity before and after, the other thread's values bitwise the
builtin's), and the packs' own counters (which calls reached them). Negative control: a layer whose
module bound `linear` before the routers went in is not routed (documented: such code keeps the builtin)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from autobucket.engine.intercept import functions as function_routes
from autobucket.engine.intercept.functions import interceptors_installed, original_addmm, original_linear
from autobucket.engine.kernels.packed_linear import PackedLinears, packed_linears


class Counting(PackedLinears):
    """PackedLinears that counts the calls reaching it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def linear(self, *args, **kwargs):  # type: ignore[override]
        self.calls += 1
        return super().linear(*args, **kwargs)

    def addmm(self, *args, **kwargs):  # type: ignore[override]
        self.calls += 1
        return super().addmm(*args, **kwargs)


def test_the_routers_are_in_only_while_a_scope_is_open_and_nest():
    assert F.linear is original_linear and torch.addmm is original_addmm
    outer, inner = Counting(), Counting()
    layer, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    with torch.no_grad(), packed_linears(outer):
        assert interceptors_installed()
        layer(x)
        with packed_linears(inner):
            layer(x)
        layer(x)
    assert (outer.calls, inner.calls) == (2, 1)
    assert F.linear is original_linear and torch.addmm is original_addmm
    assert not interceptors_installed()


@torch.no_grad()
def test_dropout_off_routes_this_threads_dropout_to_its_input():
    x = torch.randn(64, 64)
    drop = torch.nn.Dropout(0.5).train()
    assert not torch.equal(drop(x), x)  # control: dropout is live outside the scope
    q = k = v = torch.randn(1, 2, 8, 16)
    with function_routes.dropout_off():
        assert torch.equal(drop(x), x) and torch.equal(F.dropout(x, 0.5, True), x)
        with_p = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        torch.testing.assert_close(with_p, F.scaled_dot_product_attention(q, k, v))
    assert F.dropout is function_routes._ORIGINAL_DROPOUTS["dropout"] and not interceptors_installed()


def test_an_error_inside_the_scope_takes_the_routers_out():
    try:
        with packed_linears(PackedLinears()):
            raise KeyError("model error")
    except KeyError:
        pass
    assert F.linear is original_linear and torch.addmm is original_addmm


@torch.no_grad()
def test_another_threads_linears_run_the_builtin_while_a_scope_is_open():
    packs, layer = Counting(), torch.nn.Linear(64, 32)
    x = torch.randn(5, 64)
    inside, done = threading.Event(), threading.Event()
    seen: dict = {}

    def other_thread():
        inside.wait()
        seen["routers in"] = interceptors_installed()
        seen["out"] = layer(x)
        # the builtin's answer on this thread: a new thread's OpenMP pool is its own, and MKL's bits
        # follow the thread count, which the test process may have set differently on its main thread
        seen["builtin"] = original_linear(x, layer.weight, layer.bias)
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with packed_linears(packs):
        inside.set()
        done.wait(timeout=30)
    thread.join()
    assert seen["routers in"] and packs.calls == 0
    assert torch.equal(seen["out"], seen["builtin"])


@torch.no_grad()
def test_another_threads_dropout_stays_live_while_this_thread_has_it_off():
    x, drop = torch.ones(256), torch.nn.Dropout(0.5).train()
    inside, done = threading.Event(), threading.Event()
    seen: dict = {}

    def other_thread():
        inside.wait()
        seen["out"] = drop(x)
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with function_routes.dropout_off():
        inside.set()
        done.wait(timeout=30)
        assert torch.equal(drop(x), x)  # this thread: eval dropout
    thread.join()
    assert (seen["out"] == 0).any()  # the other thread: dropout applied (half the entries zeroed)


def test_a_conv1d_addmm_is_routed_and_other_addmm_calls_are_not():
    from transformers.pytorch_utils import Conv1D

    packs, conv = Counting(), Conv1D(16, 8)  # weight [8, 16] stored transposed: y = x @ W + b
    x, a, b = torch.randn(4, 8), torch.randn(4, 3), torch.randn(3, 16)
    with torch.no_grad(), packed_linears(packs, conv1d=True):
        assert torch.addmm is original_addmm
        routed = conv(x)
        torch.addmm(torch.zeros(16), a, b)  # not a Conv1D call: a plain tensor as the weight
    assert packs.calls == 1
    with torch.no_grad(), packed_linears(packs):  # a model without Conv1D layers: no mode
        conv(x)
    assert packs.calls == 1
    assert function_routes.has_conv1d(torch.nn.Sequential(conv)) and not function_routes.has_conv1d(torch.nn.Linear(2, 2))
    torch.testing.assert_close(routed, original_addmm(conv.bias, x, conv.weight), rtol=1e-5, atol=1e-6)


def test_someone_elses_replacement_made_meanwhile_is_left_alone():
    theirs = lambda *args, **kwargs: original_linear(*args, **kwargs)  # noqa: E731
    try:
        with packed_linears(PackedLinears()):
            F.linear = theirs  # type: ignore[assignment]
        assert F.linear is theirs and torch.addmm is original_addmm
    finally:
        F.linear = original_linear  # type: ignore[assignment]


def test_control_a_linear_bound_before_the_routers_is_not_routed():
    bound = F.linear  # what `from torch.nn.functional import linear` at import time holds
    packs, weight, x = Counting(), torch.randn(4, 8), torch.randn(3, 8)
    with torch.no_grad(), packed_linears(packs):
        bound(x, weight)
        F.linear(x, weight)
    assert packs.calls == 1
    assert function_routes._OPEN_SCOPES == 0


class Ready(PackedLinears):
    """PackedLinears that counts the calls its quick path took."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = 0

    def ready_linear(self, *args, **kwargs):  # type: ignore[override]
        out = super().ready_linear(*args, **kwargs)
        self.ready += out is not None
        return out


def _quick_path_available(packs: PackedLinears) -> bool:
    return packs.fixed_order  # the quick path serves the fixed-order kernel's fp32 panels


def test_call_linear_takes_the_quick_path_with_the_modules_values_and_follows_weight_updates():
    packs, layer = Ready(), torch.nn.Linear(64, 48)
    x = torch.randn(5, 1, 64)
    with packed_linears(packs):
        with torch.no_grad():
            want = layer(x)  # the module's call packs the weight
            got = function_routes.call_linear(layer, x)
        assert torch.equal(got, want)
        assert packs.ready == (1 if _quick_path_available(packs) else 0)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # an in-place update: the quick path must not serve the old panels
            updated = function_routes.call_linear(layer, x)
    with torch.no_grad():
        fresh = PackedLinears().linear(x, layer.weight, layer.bias)  # oracle: packs made after the update
    assert torch.equal(updated, fresh) and not torch.equal(updated, want)


def test_call_linear_runs_the_module_wherever_its_call_could_be_observed():
    packs, x = Ready(), torch.randn(3, 16)

    class Scaled(torch.nn.Linear):
        def forward(self, input):
            return 2 * super().forward(input)

    hooked, seen = torch.nn.Linear(16, 8), []
    hooked.register_forward_hook(lambda module, args, out: seen.append("module hook"))
    replaced = torch.nn.Linear(16, 8)
    replaced.forward = lambda input: torch.zeros(3, 8)  # instrumentation replacing one instance's forward
    plain, subclass = torch.nn.Linear(16, 8), Scaled(16, 8)
    with torch.no_grad(), packed_linears(packs):
        for layer in (hooked, replaced, plain, subclass):
            layer(x)  # packed by the module call
        seen.clear()
        assert torch.equal(function_routes.call_linear(hooked, x), hooked(x)) and seen == ["module hook"] * 2
        assert torch.equal(function_routes.call_linear(replaced, x), torch.zeros(3, 8))
        assert torch.equal(function_routes.call_linear(subclass, x), 2 * plain.__class__.forward(subclass, x))
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append("global"))
        try:
            function_routes.call_linear(plain, x)
        finally:
            handle.remove()
        assert seen[-1] == "global"
        assert packs.ready == 0  # none of them took the quick path
        function_routes.call_linear(plain, x)
        assert packs.ready == (1 if _quick_path_available(packs) else 0)  # control: the plain one does
    assert torch.equal(function_routes.call_linear(plain, x), plain(x))  # no scope: the module


def test_call_linear_under_autograd_runs_the_module_and_its_gradients():
    packs, layer = Ready(), torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    with packed_linears(packs):
        function_routes.call_linear(layer, x).sum().backward()
    assert packs.ready == 0 and x.grad is not None and layer.weight.grad is not None
    assert torch.allclose(x.grad, layer.weight.sum(0).expand(3, -1))


def test_control_a_quick_path_blind_to_weight_versions_serves_stale_values(monkeypatch):
    """Negative control for the update test above: with the version check defeated, the quick path
    serves the panels of the weight as it was, so that test's oracle can fail."""
    from autobucket.engine.kernels import packed_linear

    packs, layer, x = Ready(), torch.nn.Linear(64, 48), torch.randn(5, 1, 64)
    if not _quick_path_available(packs):
        pytest.skip("no fixed-order kernel on this CPU: no quick path to defeat")
    monkeypatch.setattr(packed_linear, "tensor_version", lambda weight: (0, 0, 0))
    with torch.no_grad(), packed_linears(packs):
        before = layer(x)
        layer.weight.mul_(2.0)
        assert torch.equal(function_routes.call_linear(layer, x), before)
