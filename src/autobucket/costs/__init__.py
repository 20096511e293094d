"""The cost model: what a forward, a KV copy and a decode step cost, and where those coefficients come from.

- `coefficients`: `CostCoefficients`, `ModelGeometry` and the cost of each event (pure Python: the planner
  reads it, so it never imports torch);
- `fit`, `packed_fit`: the non-negative least-squares fit of measured events;
- `calibration_file`: the calibration file, and its check against the model and environment;
- `online`, `store`: learning from each call's timings, and the per-fingerprint store of what was learned;
- `source`: which of those a `Rollout` uses (given, a file, or learned online);
- `calibration`: measuring this model on this device (`autobucket calibrate`).

This package's root imports nothing, so importing the pure `coefficients` stays light.
"""
