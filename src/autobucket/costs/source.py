"""Where a `Rollout`'s cost coefficients come from, and how they improve from call to call.

`RolloutConfig.costs` selects the source:

* a `CostCoefficients`: used as given ("given"; "defaults" when they are the reference's GPU values);
* a path: a calibration file, validated against the model ("file");
* ``"online"`` or None (the default): learned. The prior is the cache entry for this model's fingerprint
  ("stored", see `costs.store`), else a built-in probe of a few small calls through the real
  routes, sized from a first tiny call to take about `PROBE_BUDGET_MS` ("probe"). After every call the
  call's timings refine the coefficients (`costs.online.OnlineCosts`) and the entry is saved
  ("online"). The probe runs only when a route needs coefficients (auto, bucketed): other routes'
  timings are kept and join the probe's. `RolloutConfig.persist_costs=False` keeps all of it in this
  process: no entry is read or written. Only one process writes, and an unwritable cache folder is one
  warning, never a failed call (`costs.store.persist_entry`).

Every call's profile gets the coefficients it used, their source, and what they predict for the
call's timed events next to what those events measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import fields

import torch

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.costs.calibration_file import load_calibration
from autobucket.costs.coefficients import PREFILL_FORWARD, CostCoefficients, ModelGeometry
from autobucket.costs.online import OnlineCosts, predicted_ms
from autobucket.costs.store import entry_key, load_entry, persist_entry, store_metadata
from autobucket.profile import Profile, Timing
from autobucket.prompts import random_prompts

ONLINE = "online"
PROBE_BUDGET_MS = 3000.0  # the built-in probe's target duration
# Online learning refits (and persists) only once the calls since its last refit ran 1 / REFIT_SHARE times
# as long as that refit took, so it costs at most this share of generate time (a refit after every call
# would cost a visible share of a short call). Timings of
# the calls in between join the window at once; they count at the next refit.
REFIT_SHARE = 0.02
RunRoute = Callable[[str, list[list[int]], SamplingConfig], Profile]  # (route, prompts, sampling) -> profile
# The probe's prior: every term the timings fit starts at 0; packed_prompt_ms, which no timing measures
# (only calibration does), keeps its default.
_ZERO = CostCoefficients(**{f.name: 0.0 for f in fields(CostCoefficients) if f.name != "packed_prompt_ms"})


class CostSource:
    """The coefficients of one `Rollout`: fixed (given, file) or learned online. `window`: the model's
    attention window when it uses one; it bounds the probe's prompts as it bounds continuous batching."""

    def __init__(
        self, config: RolloutConfig, model: torch.nn.Module, geometry: ModelGeometry, window: int | None = None
    ) -> None:
        self.model, self.geometry, self.window = model, geometry, window
        self.learner: OnlineCosts | None = None
        self.pending: list[Timing] = []  # online timings seen before the learner exists
        costs = config.costs
        self.online = costs is None or (isinstance(costs, str) and costs == ONLINE)
        self.persist = self.online and config.persist_costs  # read and write the cache entry
        if self.online:
            self.fixed, self.source = None, ONLINE
        elif isinstance(costs, CostCoefficients):
            self.fixed, self.source = costs, "defaults" if costs == CostCoefficients() else "given"
        else:
            self.fixed, self.source = load_calibration(costs, model=model, strict=config.costs_strict), "file"
        self.config = config
        self.metadata = store_metadata(model, config.kernels) if self.online else {}
        self._entry_read = False  # whether the stored entry (if persisting) was looked up
        self._refit_ms = 0.0  # what the last refit took (0: the next call refits)
        self._since_refit_ms = 0.0  # measured ms of the calls since then
        self._set_aside: dict[str, tuple] = {}  # other fingerprints' learning, by entry key (`follow`)

    def follow(self, geometry: ModelGeometry) -> None:
        """The model's fingerprint changed since the last call (a trainer's `model.to(torch.bfloat16)`, a
        new device, thread count or attention): timings of the old one must not plan the new one, so
        online learning continues where this fingerprint's left off — set aside in this process, else its
        stored entry, else a probe. A calibration file is validated against the model as it is now, as at
        construction (`costs_strict`: refused, else warned); given coefficients stay as given."""
        if self.source == "file":  # before anything changes: refused, the next call checks again
            self.fixed = load_calibration(self.config.costs, model=self.model, strict=self.config.costs_strict)
        self.geometry = geometry
        if not self.online:
            return
        metadata = store_metadata(self.model, self.config.kernels)
        if metadata == self.metadata:
            return
        self._set_aside[entry_key(self.metadata)] = {name: getattr(self, name) for name in _fresh_learning()}
        self.metadata = metadata
        learning = self._set_aside.pop(entry_key(metadata), None) or _fresh_learning()
        for name, value in learning.items():
            setattr(self, name, value)

    def current(self, run: RunRoute | None) -> CostCoefficients | None:
        """Coefficients to plan with; online without a prior, `run` probes (None: do not probe)."""
        if self.fixed is not None:
            return self.fixed
        if self.learner is None:
            self._start(run)
        return None if self.learner is None else self.learner.costs

    def _start(self, run: RunRoute | None) -> None:
        # The stored entry is read once: a fixed route's calls never probe, so they would otherwise read
        # (and, for a stale entry, warn about) the same file on every call.
        entry = load_entry(self.metadata) if self.persist and not self._entry_read else None
        self._entry_read = True
        if entry is not None:
            costs, observations, _ = entry
            self.learner, self.source = OnlineCosts(costs, self.geometry, observations), "stored"
        elif run is not None:
            timings = probe(run, self.geometry, self.model, self.window)
            self.learner, self.source = OnlineCosts(_ZERO, self.geometry), "probe"
            self.learner.observe(timings + self.pending)
            self._save()
        else:
            return
        self.pending = []

    def after_call(self, profile: Profile, costs: CostCoefficients | None) -> None:
        """Fill the profile's cost fields (`costs`: what the call planned with), then learn from it."""
        profile.measured_ms = sum(t.ms for t in profile.timings)
        used = costs if costs is not None else self.current(None)
        profile.costs_source = self.source
        if used is not None:
            profile.costs = used.to_dict()
            profile.predicted_ms = predicted_ms(profile.timings, self.geometry, used)
        if not self.online:
            return
        if self.learner is None:
            self.pending = (self.pending + profile.timings)[-1000:]
            return
        self.learner.add(profile.timings)
        self.source = ONLINE
        self._since_refit_ms += profile.measured_ms
        if self._since_refit_ms * REFIT_SHARE >= self._refit_ms:
            started = time.perf_counter()
            self.learner.refit()
            self._save()
            self._refit_ms, self._since_refit_ms = (time.perf_counter() - started) * 1e3, 0.0

    def _save(self) -> None:
        if self.persist and self.learner is not None:
            persist_entry(self.metadata, self.learner.costs, self.learner.observations(), self.source)


def _fresh_learning() -> dict:
    """What online learning holds for one fingerprint (`CostSource.follow` sets it aside and restores it),
    as a new CostSource starts it: its stored entry or a probe, at first need."""
    return {"learner": None, "source": ONLINE, "pending": [], "_entry_read": False, "_refit_ms": 0.0,
            "_since_refit_ms": 0.0}


def probe(run: RunRoute, geometry: ModelGeometry, model: torch.nn.Module, window: int | None = None) -> list[Timing]:
    """Timings of a few small calls through the real routes (prefill shapes of several B and L, CB and
    ordinary decode steps), sized so that the whole probe takes about PROBE_BUDGET_MS."""
    # Token ids do not change a dense model's timings; ids below 256 are ordinary tokens in any vocabulary
    # (and stay clear of the special ids that sit at the top of many).
    vocab = min(256, int(model.get_output_embeddings().weight.shape[0]))
    sampling = SamplingConfig(max_new_tokens=6, continuous_batch_size=64, eos_token_id=[], stop_strings=[])
    first = run("ordinary", random_prompts([32, 32], vocab, seed=1), sampling)
    forward_ms = sum(t.ms for t in first.timings if t.kind == PREFILL_FORWARD)
    # A sliding attention window bounds what continuous batching runs (routes.py), the probe's calls too.
    positions = _least(geometry.max_positions, window)
    unit = _probe_unit(forward_ms / 64, positions)
    # One long prompt whatever the budget: short prompts leave the attention term (∝ L²) unidentified, and
    # extrapolated from them it can be off by an order of magnitude.
    long = max(2 * unit, min(512, ((positions or 1024) - 8) // 2))
    calls = (("aligned", [max(unit // 8, 1), unit // 2, unit, long]),
             ("equal_width", [unit // 2] * 8), ("equal_width", [unit] * 4), ("ordinary", [unit // 2] * 8))
    timings = list(first.timings)
    for seed, (route, lengths) in enumerate(calls, start=2):
        timings += run(route, random_prompts(lengths, vocab, seed=seed), sampling).timings
    return timings


def _least(*limits: int | None) -> int | None:
    present = [limit for limit in limits if limit is not None]
    return min(present) if present else None


def _probe_unit(token_ms: float, max_positions: int | None) -> int:
    """A power-of-two prompt length u: the probe prefills about 16·u tokens."""
    budget_tokens = PROBE_BUDGET_MS / max(token_ms, 1e-6) / 16
    limit = 256 if max_positions is None else max(min(256, (max_positions - 8) // 2), 2)
    return 2 ** max(1, min(int(math.log2(max(budget_tokens, 2))), int(math.log2(limit))))
