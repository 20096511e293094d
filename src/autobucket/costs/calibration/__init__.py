"""Measuring the engine on this model and device (`calibrate`): which shapes (`plans`), timed rounds of the
engine's own steps under a deadline (`measure`, `timing`), then the fit (`autobucket.costs.fit`)."""

from autobucket.costs.calibration.measure import (
    CalibrationPlan,
    calibrate,
    default_plan,
    quick_fit,
    quick_plan,
)

__all__ = ["CalibrationPlan", "calibrate", "default_plan", "quick_fit", "quick_plan"]
