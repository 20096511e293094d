"""Deprecated: the cost model lives in `autobucket.costs`; this name re-exports its calibration functions
for one release."""

import warnings

from autobucket.costs.calibration.measure import (
    CalibrationPlan,
    calibrate,
    default_plan,
    quick_fit,
    quick_plan,
)

__all__ = ["CalibrationPlan", "calibrate", "default_plan", "quick_fit", "quick_plan"]

warnings.warn(
    "autobucket.calibration is deprecated and will be removed in the next release: import CalibrationPlan, "
    "calibrate, default_plan, quick_fit and quick_plan from autobucket.costs.calibration",
    DeprecationWarning,
    stacklevel=2,
)
