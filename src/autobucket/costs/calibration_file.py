"""The calibration file: coefficients plus what they were measured on, saved as JSON and checked on load.

Coefficients are only valid for the model, dtype, device and attention backend they were measured on, so
a calibration carries metadata and loading compares it with the model it is about to drive:

* **must match** (else `ValueError`, or a warning with ``strict=False``): ``config_hash``, ``dtype``,
  ``device``, ``attn_implementation``;
* **warn only**: torch / transformers / autobucket versions, the source fingerprint of the planner and
  engine, the thread count — they can shift costs, but not by a change of kind.

A plain coefficient JSON (the reference's format, no metadata) is still accepted, with a warning that
nothing about it could be validated.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from autobucket.costs.coefficients import CostCoefficients, load_costs

SCHEMA_VERSION = 1
MUST_MATCH = ("config_hash", "dtype", "device", "attn_implementation")
WARN_ONLY = ("torch", "transformers", "autobucket", "source_fingerprint", "threads")
REQUIRED_METADATA = ("model", *MUST_MATCH, *WARN_ONLY, "date")
# Sources whose change can change what a calibration means: the planner and the engine paths whose speed
# the coefficients describe (paths below the package root).
FINGERPRINT_SOURCES = (
    "costs/coefficients.py", "planning/planner.py", "engine/batching/batcher.py", "engine/batching/model_runner.py",
    "engine/batching/static_cache.py", "engine/batching/prefill.py", "engine/routes.py", "planning/forms.py",
    "engine/batching/packed_prefill.py", "engine/admission.py", "engine/intercept/attention.py", "engine/batching/decode_rows.py",
)
# Config fields that change with how a model was loaded, not with what it is.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "_commit_hash", "dtype", "torch_dtype",
    "_attn_implementation", "_attn_implementation_internal", "_attn_implementation_autoset",
    "attn_implementation",
})  # fmt: skip
_OVERRIDE_HINT = "pass RolloutConfig(costs_strict=False) / load_calibration(strict=False) / --allow-mismatch to use it anyway"


def config_hash(config: Any) -> str:
    """sha256 of the model config as sorted-key JSON, without load-dependent fields."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = json.dumps(_without_volatile(data), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_volatile(v) for v in value]
    return value


def source_fingerprint() -> str:
    """sha256 over the planner and engine sources (name and bytes of each)."""
    digest = hashlib.sha256()
    folder = Path(__file__).parents[1]
    for name in FINGERPRINT_SOURCES:
        digest.update(name.encode("utf-8") + b"\0" + (folder / name).read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache  # read once per process: the CPU does not change under it
def host_cpu() -> str:
    """This machine's CPU kind: `/proc/cpuinfo`'s model name, family and model, and the vector
    extensions that change which kernels are fastest (e.g. "<model name> family 25 model 17 avx512f
    avx512_bf16"); `platform.processor()` where there is no `/proc/cpuinfo`. Model names alone do not
    tell CPU kinds apart on cloud VMs, where two generations of one product line report the same name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    fields: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            break  # the first processor's block describes them all
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    extensions = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if flag in flags]
    described = [fields.get("model name", "unknown"), f"family {fields.get('cpu family', '?')}",
                 f"model {fields.get('model', '?')}", *extensions]
    return " ".join(described)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def model_metadata(model: torch.nn.Module) -> dict[str, str]:
    """The MUST_MATCH fields for a loaded model."""
    parameter = next(model.parameters())
    return {
        "config_hash": config_hash(model.config),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": device_name(parameter.device),
        "attn_implementation": getattr(model.config, "_attn_implementation", None) or "eager",
    }


def environment_metadata() -> dict[str, Any]:
    """The WARN_ONLY fields for this process."""
    import transformers

    import autobucket

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "autobucket": autobucket.__version__,
        "source_fingerprint": source_fingerprint(),
        "threads": torch.get_num_threads(),
    }


def calibration_metadata(model: torch.nn.Module, model_name: str = "") -> dict[str, Any]:
    return {
        "model": model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        **model_metadata(model),
        **environment_metadata(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def save_calibration(
    path: str | Path,
    costs: CostCoefficients,
    metadata: dict[str, Any],
    measurements: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the calibration JSON (atomically: a reader never sees half a file)."""
    missing = [name for name in REQUIRED_METADATA if name not in metadata]
    if missing:
        raise ValueError(f"calibration metadata lacks {missing}; build it with calibration_metadata(model)")
    document = {"schema_version": SCHEMA_VERSION, "costs": costs.to_dict(), "metadata": metadata,
                **(extra or {}), "measurements": measurements or {}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    temporary.replace(path)


def load_calibration(
    path: str | Path, model: torch.nn.Module | None = None, strict: bool = True
) -> CostCoefficients:
    """Coefficients from a calibration file, validated against ``model`` when given.

    A plain coefficient JSON (no ``schema_version``) loads with a warning that it is unvalidated.
    Corrupt files, a wrong schema version, incomplete metadata, or (with ``strict``) a mismatch on any
    MUST_MATCH field raise ValueError naming the path and every differing field.
    """
    document = _read_json(path)
    if not isinstance(document, dict) or "schema_version" not in document:
        costs = load_costs(path)
        warnings.warn(
            f"cost file {str(path)!r} has no calibration metadata, so nothing about it could be validated "
            "against this model; create one with `autobucket calibrate`",
            stacklevel=2,
        )
        return costs
    metadata = _checked_document(path, document)
    if model is not None:
        _check_against_model(path, metadata, model, strict)
    try:
        return CostCoefficients.from_dict(document["costs"])
    except ValueError as exc:
        raise ValueError(f"calibration file {str(path)!r}: {exc}") from exc


def _read_json(path: str | Path) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read calibration file {str(path)!r}: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"calibration file {str(path)!r} is not valid JSON ({exc}); recreate it with `autobucket calibrate`"
        ) from exc


def _checked_document(path: str | Path, document: dict[str, Any]) -> dict[str, Any]:
    version = document["schema_version"]
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"calibration file {str(path)!r} has schema_version={version!r}, this autobucket reads "
            f"{SCHEMA_VERSION}; recreate it with `autobucket calibrate`"
        )
    metadata = document.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(document.get("costs"), dict):
        raise ValueError(f"calibration file {str(path)!r} needs a 'costs' object and a 'metadata' object")
    missing = [name for name in REQUIRED_METADATA if name not in metadata]
    if missing:
        raise ValueError(f"calibration file {str(path)!r}: metadata lacks {missing}; recreate it")
    return metadata


def _check_against_model(
    path: str | Path, metadata: dict[str, Any], model: torch.nn.Module, strict: bool
) -> None:
    current = {**model_metadata(model), **environment_metadata()}
    differing = [f"{name}: file {metadata[name]!r} vs now {current[name]!r}"
                 for name in MUST_MATCH if metadata[name] != current[name]]
    if differing:
        message = (
            f"calibration file {str(path)!r} was measured on a different setup ({'; '.join(differing)}): "
            f"recalibrate with `autobucket calibrate`, or {_OVERRIDE_HINT}"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)
    drifted = [f"{name}: file {metadata[name]!r} vs now {current[name]!r}"
               for name in WARN_ONLY if metadata[name] != current[name]]
    if drifted:
        warnings.warn(
            f"calibration file {str(path)!r} comes from a different environment ({'; '.join(drifted)}); "
            "the coefficients may be off: consider recalibrating",
            stacklevel=3,
        )
