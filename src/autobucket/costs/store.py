"""What online learning learned, kept per model/device/dtype/attention backend/kernels/host CPU/threads in
the cache folder.

One JSON file per fingerprint: ``$AUTOBUCKET_CACHE_DIR/online-costs/<sha256[:16]>.json`` (default root
``~/.cache/autobucket``), holding the coefficients, the observation window they were fitted to (so the next
process keeps learning where this one stopped) and the metadata they are valid for. Writes are atomic
(temporary file + rename): a reader sees the old entry or the new one, never half of one.

An entry is used only when every field of its metadata equals this process's (the calibration file's
must-match fields, the thread count, the torch version and the engine's source fingerprint); a corrupt,
stale or mismatched entry is ignored with a one-line warning, and overwritten by the next save.

One process writes (`persist_entry`): under data parallelism every rank learns the same model on the same
kind of device, so N ranks would rewrite one file N times per step. The writer is rank 0 of
`torch.distributed` when it is initialised, else the process whose `RANK` environment variable (torchrun,
accelerate and deepspeed launchers set it) is 0 or unset; the other ranks still read. A cache folder that
cannot be written is warned about once per entry and process and not retried: learning goes on in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from autobucket.costs.calibration_file import host_cpu, model_metadata, source_fingerprint
from autobucket.costs.coefficients import CostCoefficients
from autobucket.models import CACHE_DIR_ENV
from autobucket.profile import Timing

STORE_SCHEMA_VERSION = 1
_FOLDER = "online-costs"
RANK_ENV = "RANK"  # the global rank that torchrun, accelerate and deepspeed launchers export
_UNWRITABLE: set[Path] = set()  # entries whose save failed in this process: warned once, not retried


def store_metadata(model: torch.nn.Module, kernels: str = "torch") -> dict[str, Any]:
    """Everything an entry must match to be trusted for `model` in this process, with `kernels`
    (`RolloutConfig.kernels`). The kernel set and the host CPU are part of the key: the same call takes
    a different time on the two kernel sets, and on two CPU kinds by a wide margin, so costs learned for
    one must not plan the other (a home folder shared by a cluster's
    nodes, or two Rollouts of one model with different kernels, would otherwise overwrite each other's)."""
    return {
        **model_metadata(model),
        "kernels": kernels,
        "cpu": host_cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "source_fingerprint": source_fingerprint(),
    }


ENTRY_KEY_FIELDS = ("config_hash", "dtype", "device", "attn_implementation", "kernels", "cpu", "threads")


def entry_key(metadata: dict[str, Any]) -> str:
    """The fingerprint an entry is stored under: a digest of its ENTRY_KEY_FIELDS."""
    keyed = {name: metadata[name] for name in ENTRY_KEY_FIELDS}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def entry_path(metadata: dict[str, Any]) -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "autobucket"
    return Path(root).expanduser() / _FOLDER / f"{entry_key(metadata)}.json"


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
    try:
        temporary.write_text(json.dumps(document) + "\n", encoding="utf-8")
        temporary.replace(path)
    except OSError:
        with contextlib.suppress(OSError):  # the original error is the one to report
            temporary.unlink(missing_ok=True)
        raise
    return path


def writer_rank() -> int:
    """This process's rank for the one-writer rule: torch.distributed's when initialised, else `$RANK`, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get(RANK_ENV, "0"))
    except ValueError:  # not a launcher's rank: a single process
        return 0


def persist_entry(
    metadata: dict[str, Any], costs: CostCoefficients, observations: list[Timing], source: str
) -> Path | None:
    """`save_entry` from the one writing process (the path), else None: another rank writes, or this
    entry could not be written (one warning per entry and process; never an error for the caller)."""
    path = entry_path(metadata)
    if writer_rank() != 0 or path in _UNWRITABLE:
        return None
    try:
        return save_entry(metadata, costs, observations, source)
    except OSError as exc:
        _UNWRITABLE.add(path)
        reason = " ".join(str(exc).split())
        warnings.warn(f"learned costs are kept in memory only: cannot write {str(path)!r} ({reason})", stacklevel=3)
        return None


def load_entry(metadata: dict[str, Any]) -> tuple[CostCoefficients, list[Timing], str] | None:
    """(costs, observations, source) of the entry for `metadata`, or None (absent, or ignored with a notice)."""
    path = entry_path(metadata)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no entry (a cache root that is a file holds none)
        return None
    except (OSError, UnicodeDecodeError) as exc:
        warnings.warn(f"ignoring the learned cost entry {str(path)!r}: {exc}", stacklevel=3)
        return None
    try:
        return _parsed_entry(json.loads(text), metadata)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        warnings.warn(f"ignoring the learned cost entry {str(path)!r}: {exc}", stacklevel=3)
        return None


def _parsed_entry(document: Any, metadata: dict[str, Any]) -> tuple[CostCoefficients, list[Timing], str]:
    if not isinstance(document, dict) or document.get("schema_version") != STORE_SCHEMA_VERSION:
        raise ValueError(f"not a schema_version {STORE_SCHEMA_VERSION} entry")
    differing = [f"{name} {document['metadata'].get(name)!r} != {value!r}"
                 for name, value in metadata.items() if document["metadata"].get(name) != value]
    if differing:
        raise ValueError("stale or for another setup (" + "; ".join(differing) + ")")
    observations = [Timing(str(kind), int(rows), int(width), float(ms))
                    for kind, rows, width, ms in document["observations"]]
    return CostCoefficients.from_dict(document["costs"]), observations, str(document["source"])
