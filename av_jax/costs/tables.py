"""Step-cost tables: what the planner and the modelled clock price a step with.

`CostTables` holds a deployment's per-depth draft table and per-bucket verify table
(modelled by `av_jax.costs.roofline`, or measured by `benchmarks/accelerator.py`) and
the planner's `CostModel` of them; `save_cost_table` / `load_cost_table` write and read
the measured tables' JSON format. Milliseconds throughout.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from av_jax.selection import CostModel, make_cost_model

COST_TABLE_FORMAT = "av_jax-cost-table"
COST_TABLE_VERSION = 1


class CostTables(NamedTuple):
  """Step-cost tables of one deployment (modelled by the roofline, or measured).

  `cost` is what the planner decides with. The engine's modelled clock charges a step
  `draft_depth_ms[R, :depths_run].sum() + bucket_ms[bucket]`, so a step that drafts fewer
  depths (or none) pays less; `cost.draft_ms[R]` is the full K-depth row sum.
  """
  cost: CostModel             # draft_ms [R_max + 1], verify_ms [T_max + 1] (milliseconds)
  draft_depth_ms: np.ndarray  # [R_max + 1, K] float64, ms of drafting depth k with R
                              # requests (a parallel drafter pays its pass at depth 0)
  buckets: tuple[int, ...]    # packed-token sizes T of the verify programs, ascending
  bucket_ms: np.ndarray       # [num_buckets] float64, ms of verifying one bucket
  label: str                  # "modelled: ..." or "measured: ..." (device and shapes)
  terms: dict                 # per-bucket ms of each roofline term (empty if measured)


def draft_fixed_from_depths(draft_depth_ms) -> np.ndarray:
  """`[R_max + 1]`: the part of a row's drafting cost paid whatever depth is drafted.

  Drafting c of K depths costs the row's first c entries; the planner prices it
  `fixed + (c / K) (full - fixed)` (`CostModel.draft_share_cost`), exact at c = 1 and
  c = K with `fixed = depth_1 - mean(depth_2..K)`, clipped to [0, full]. An autoregressive
  drafter's first depth consumes the pending block (K + 1 tokens a request) and costs
  more than each later one; a parallel drafter pays everything at depth 1 (fixed = full).
  """
  depth = np.asarray(draft_depth_ms, np.float64)
  full = depth.sum(axis=1)
  if depth.shape[1] < 2:
    return full
  fixed = depth[:, 0] - depth[:, 1:].mean(axis=1)
  return np.clip(fixed, 0.0, full)


def depth_cost_model(draft_depth_ms, verify_ms) -> CostModel:
  """The planner's `CostModel` of a per-depth draft table and a verify table: a row's
  full K-depth sum, its fixed part (`draft_fixed_from_depths`) and `verify_ms`."""
  depth = np.asarray(draft_depth_ms, np.float64)
  return make_cost_model(depth.sum(axis=1), verify_ms,
                         draft_fixed_ms=draft_fixed_from_depths(depth))


def _step_function(buckets: Sequence[int], bucket_ms: np.ndarray, max_tokens: int) -> np.ndarray:
  """`[max_tokens + 1]`: T tokens cost what the smallest bucket >= T costs."""
  t = np.arange(max_tokens + 1)
  index = np.minimum(np.searchsorted(np.asarray(buckets), t, side="left"), len(buckets) - 1)
  return np.maximum.accumulate(np.asarray(bucket_ms, np.float64))[index]


# ---------------------------------------------------------------------- measured tables


def save_cost_table(path: str, tables: CostTables, *,
                    metadata: Mapping[str, Any] | None = None) -> None:
  """Writes `tables` as a cost-table JSON file (`load_cost_table` reads it back).

  Format (version 1): `{"format": "av_jax-cost-table", "version": 1, "label": str,
  "buckets": [T...], "bucket_ms": [ms...], "draft_depth_ms": [[ms per depth] per R =
  0..R_max], "metadata": {...}}`. Milliseconds throughout.
  """
  blob = dict(format=COST_TABLE_FORMAT, version=COST_TABLE_VERSION, label=tables.label,
              buckets=[int(t) for t in tables.buckets],
              bucket_ms=[float(x) for x in tables.bucket_ms],
              draft_depth_ms=np.asarray(tables.draft_depth_ms, np.float64).tolist(),
              metadata=dict(metadata or {}))
  with open(path, "w") as f:
    json.dump(blob, f, indent=1)


def cost_tables_from_dict(blob: Mapping[str, Any], *, max_tokens: int | None = None) -> CostTables:
  """`CostTables` from a parsed cost-table file (see `save_cost_table`).

  Args:
    blob: the parsed JSON.
    max_tokens: T_max of the verify table; default the largest bucket (tokens beyond the
      largest measured bucket cost what it costs, as in the engine's profile).

  Raises:
    ValueError: naming the field, for a wrong format or version, or malformed tables.
  """
  if blob.get("format") != COST_TABLE_FORMAT:
    raise ValueError(f"format: expected {COST_TABLE_FORMAT!r}, got {blob.get('format')!r}")
  if blob.get("version") != COST_TABLE_VERSION:
    raise ValueError(f"version: expected {COST_TABLE_VERSION}, got {blob.get('version')!r}")
  buckets = [int(t) for t in blob.get("buckets", [])]
  bucket_ms = np.asarray(blob.get("bucket_ms", []), np.float64)
  if not buckets or bucket_ms.shape != (len(buckets),):
    raise ValueError(f"bucket_ms: expected one cost per bucket ({len(buckets)} buckets), got "
                     f"shape {bucket_ms.shape}")
  if sorted(set(buckets)) != buckets or buckets[0] < 1:
    raise ValueError(f"buckets: expected ascending positive sizes, got {buckets}")
  depth = np.asarray(blob.get("draft_depth_ms", []), np.float64)
  if depth.ndim != 2 or depth.shape[0] < 1:
    raise ValueError(f"draft_depth_ms: expected a [R_max + 1, K] table, got shape "
                     f"{depth.shape}")
  top = buckets[-1] if max_tokens is None else int(max_tokens)
  verify = _step_function(buckets, bucket_ms, top)
  cost = depth_cost_model(depth, verify)
  return CostTables(cost=cost, draft_depth_ms=depth, buckets=tuple(buckets),
                    bucket_ms=bucket_ms, label=str(blob.get("label", "measured")), terms={})


def load_cost_table(path: str, *, max_tokens: int | None = None) -> CostTables:
  """Reads a cost-table file (`save_cost_table`, `benchmarks/accelerator.py`).

  Use `.cost` (a `CostModel`) in place of the roofline's.

  Raises:
    ValueError: naming the path and the field, for a malformed file.
  """
  with open(path) as f:
    blob = json.load(f)
  try:
    return cost_tables_from_dict(blob, max_tokens=max_tokens)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
