"""Deprecated: the cost model lives in `autobucket.costs`; this name re-exports its calibration-file
functions for one release."""

import warnings

from autobucket.costs.calibration_file import load_calibration, save_calibration

__all__ = ["load_calibration", "save_calibration"]

warnings.warn(
    "autobucket.coefficients is deprecated and will be removed in the next release: import load_calibration "
    "and save_calibration from autobucket.costs.calibration_file",
    DeprecationWarning,
    stacklevel=2,
)
