"""Where the cost model's coefficients come from: the calibration file (validated against the model),
the NNLS fit of measurements. The engine reads coefficients from here; `calibration` measures them."""

from autobucket.coefficients.file import load_calibration, save_calibration

__all__ = ["load_calibration", "save_calibration"]
