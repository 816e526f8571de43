"""`Hardware`: one GPU model and the network around it, loaded from a YAML preset.

Presets live in ``configs/hardware/`` (A100 80GB, H100 80GB, H200 141GB); a user adds a file of the
same fields for theirs and names it by path or by file stem. Bandwidths are per GPU and per
direction.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megazero.core.suggest import did_you_mean
from megazero.planner.layout import PlanError
from megazero.planner.machine import Efficiency

GIB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    """name; peak_tflops: dense bf16/fp16 tensor-core TFLOP/s; hbm_gib: device memory; hbm_bandwidth_tbs;
    gpus_per_node; nvlink_gbs: GB/s per GPU per direction inside a node; internode_gbs: GB/s per
    GPU per direction between nodes; efficiency: (field, value) pairs of `machine.Efficiency` this machine
    was measured to have (``plan.py --calibrate`` writes them; a preset has none: the fitted defaults);
    cores_per_node: on a CPU, the cores the node's ranks share (``--calibrate`` writes it; 0: accelerators,
    one per rank)."""

    name: str
    peak_tflops: float
    hbm_gib: float
    hbm_bandwidth_tbs: float
    gpus_per_node: int
    nvlink_gbs: float
    internode_gbs: float
    efficiency: tuple = ()
    cores_per_node: int = 0

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB

    def tuned(self, efficiency):
        """`efficiency` (an `Efficiency`) with this machine's measured fields in place of its own."""
        return efficiency.replace(**dict(self.efficiency)) if self.efficiency else efficiency


OPTIONAL = ("efficiency", "cores_per_node")
FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name not in OPTIONAL]
EFFICIENCY_FIELDS = [f.name for f in dataclasses.fields(Efficiency)]


def presets(directory: str) -> dict[str, str]:
    """{file stem: path} of the YAML presets in `directory`."""
    if not os.path.isdir(directory):
        return {}
    return {os.path.splitext(f)[0]: os.path.join(directory, f) for f in sorted(os.listdir(directory))
            if f.endswith((".yaml", ".yml"))}


def load_hardware(name: str, directory: str) -> Hardware:
    """The preset `name` (a file stem in `directory`) or the YAML file at path `name`; `PlanError`
    naming the valid presets or the bad field otherwise."""
    known = presets(directory)
    path = name if name.endswith((".yaml", ".yml")) or os.sep in name else known.get(name)
    if path is None or not os.path.isfile(path):
        raise PlanError(f"--hardware {name!r}: no such preset or file; presets: {', '.join(known) or '(none)'}"
                        f"{did_you_mean(name, known)}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path))
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise PlanError(f"--hardware {path}: cannot read it as YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise PlanError(f"--hardware {path}: expected a mapping of {', '.join(FIELDS)}")
    unknown = [k for k in raw if k not in FIELDS and k not in OPTIONAL]
    missing = [k for k in FIELDS if k not in raw]
    if unknown or missing:
        parts = ([f"unknown field(s) {', '.join(unknown)}{did_you_mean(unknown[0], FIELDS)}"] if unknown else []) + \
                ([f"missing {', '.join(missing)}"] if missing else [])
        raise PlanError(f"--hardware {path}: " + "; ".join(parts))
    for k in FIELDS[1:]:
        v = raw[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise PlanError(f"--hardware {path}: {k}={v!r} must be a positive number")
    if not isinstance(raw["gpus_per_node"], int):
        raise PlanError(f"--hardware {path}: gpus_per_node={raw['gpus_per_node']!r} must be an integer")
    tuned = raw.get("efficiency") or {}
    if not isinstance(tuned, dict):
        raise PlanError(f"--hardware {path}: efficiency must be a mapping of {', '.join(EFFICIENCY_FIELDS)}")
    for k, v in tuned.items():
        if k not in EFFICIENCY_FIELDS:
            raise PlanError(f"--hardware {path}: efficiency.{k} is not a field{did_you_mean(k, EFFICIENCY_FIELDS)}; "
                            f"fields: {', '.join(EFFICIENCY_FIELDS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise PlanError(f"--hardware {path}: efficiency.{k}={v!r} must be a number >= 0")
        if k == "in_step" and v <= 0:
            raise PlanError(f"--hardware {path}: efficiency.in_step={v!r} must be > 0 (a step's compute over its "
                            f"kernels'; 1: as timed alone)")
    cores = raw.get("cores_per_node", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise PlanError(f"--hardware {path}: cores_per_node={cores!r} must be an integer >= 0")
    return Hardware(**{k: raw[k] for k in FIELDS}, efficiency=tuple(sorted(tuned.items())), cores_per_node=cores)
