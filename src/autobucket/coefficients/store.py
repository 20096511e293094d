"""What online learning learned, kept per model/device/dtype/attention backend/threads in the cache folder.

One JSON file per fingerprint: ``$AUTOBUCKET_CACHE_DIR/online-costs/<sha256[:16]>.json`` (default root
``~/.cache/autobucket``), holding the coefficients, the observation window they were fitted to (so the next
process keeps learning where this one stopped) and the metadata they are valid for. Writes are atomic
(temporary file + rename): a reader sees the old entry or the new one, never half of one.

An entry is used only when every field of its metadata equals this process's (the calibration file's
must-match fields, the thread count, the torch version and the engine's source fingerprint); a corrupt,
stale or mismatched entry is ignored with a one-line warning, and overwritten by the next save.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from autobucket.coefficients.file import model_metadata, source_fingerprint
from autobucket.models import CACHE_DIR_ENV
from autobucket.planning.costs import CostCoefficients
from autobucket.profile import Timing

STORE_SCHEMA_VERSION = 1
_FOLDER = "online-costs"


def store_metadata(model: torch.nn.Module) -> dict[str, Any]:
    """Everything an entry must match to be trusted for `model` in this process."""
    return {
        **model_metadata(model),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "source_fingerprint": source_fingerprint(),
    }


def entry_path(metadata: dict[str, Any]) -> Path:
    keyed = {name: metadata[name] for name in ("config_hash", "dtype", "device", "attn_implementation", "threads")}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "autobucket"
    return Path(root).expanduser() / _FOLDER / f"{key}.json"


def save_entry(
    metadata: dict[str, Any], costs: CostCoefficients, observations: list[Timing], source: str
) -> Path:
    path = entry_path(metadata)
    document = {
        "schema_version": STORE_SCHEMA_VERSION,
        "metadata": metadata,
        "source": source,
        "costs": costs.to_dict(),
        "observations": [[t.kind, t.rows, t.width, t.ms] for t in observations],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path


def load_entry(metadata: dict[str, Any]) -> tuple[CostCoefficients, list[Timing], str] | None:
    """(costs, observations, source) of the entry for `metadata`, or None (absent, or ignored with a notice)."""
    path = entry_path(metadata)
    if not path.exists():
        return None
    try:
        return _parsed_entry(json.loads(path.read_text(encoding="utf-8")), metadata)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        warnings.warn(f"ignoring the learned cost entry {str(path)!r}: {exc}", stacklevel=3)
        return None


def _parsed_entry(document: Any, metadata: dict[str, Any]) -> tuple[CostCoefficients, list[Timing], str]:
    if not isinstance(document, dict) or document.get("schema_version") != STORE_SCHEMA_VERSION:
        raise ValueError(f"not a schema_version {STORE_SCHEMA_VERSION} entry")
    differing = [f"{name} {document['metadata'].get(name)!r} != {value!r}"
                 for name, value in metadata.items() if document["metadata"].get(name) != value]  # fmt: skip
    if differing:
        raise ValueError("stale or for another setup (" + "; ".join(differing) + ")")
    observations = [Timing(str(kind), int(rows), int(width), float(ms))
                    for kind, rows, width, ms in document["observations"]]  # fmt: skip
    return CostCoefficients.from_dict(document["costs"]), observations, str(document["source"])
