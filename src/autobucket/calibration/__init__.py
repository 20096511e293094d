"""Measuring the engine on this model and device (`calibrate`) to fit cost coefficients."""

from autobucket.calibration.measure import CalibrationPlan, calibrate, default_plan, quick_fit, quick_plan

__all__ = ["CalibrationPlan", "calibrate", "default_plan", "quick_fit", "quick_plan"]
