"""The modelled clock: what a deployment would pay for the steps the engine ran.

Acceptance comes from the real models the engine runs; time comes from a deployment's
step-cost tables (`av_jax.costs.CostTables`: a roofline of a named device and model
shape, or a measured table). Serving-stack studies of speculation policies split the
problem the same way (vLLM's adaptive speculation profiles verify cost by target tokens
and draft cost by requests; SmartSpec, Liu et al. 2024). Every step is charged exactly a
sum of table entries for what it did (`step_ms`):

    charge = draft_depth_ms[D, :draft_passes].sum() + verify

* `D` = the requests that drafted (`StepInfo.draft_slots` summed): every active request
  on an ungated step, only those the decider's plan lets draft under subset drafting (a
  serving stack drafts only those; tables of av_jax's own implementation have every row
  equal to row B, so the index does not matter there). Records made before per-slot
  drafting (no `draft_slots`) charge every active request;
* `draft_passes` = `StepInfo.draft_passes`: K for an autoregressive drafter drafting
  every depth (fewer when it stops early), 1 for a parallel drafter's single pass (its
  whole cost sits at depth 0), 0 for a step that drafted nothing;
* `verify`, by `verify=`:
  - "tokens" (default): `cost.verify_ms[T]`, T = `active + verified`, the target tokens
    the step verified (each active request's base token plus its verified drafts; for
    the oracle only the accepted drafts, its hindsight accounting). This is what a
    deployment that verifies exactly the tokens it needs pays; the engine's padded
    bucket is an artefact of its static CPU programs. With tables built on the
    engine's buckets (`buckets=engine.buckets`) `verify_ms` is their step function and
    the charge equals the bucket the step ran (one verify group).
  - "bucket": `bucket_ms[StepInfo.bucket]`, the padded bucket the engine ran; the
    tables' buckets must be the engine's.
* steps with no active request (the tail of a chunk after the last request finished)
  are not charged: a serving stack does not run them.

Prefill is not charged (decode throughput only), in either clock.

Example:
  >>> tables = costs.roofline_costs("llama3-8b", "llama3-8b-dflash", "h200",
  ...                               drafter_kind="block", num_slots=8, max_draft=4,
  ...                               context_len=2048)
  >>> ms = step_ms(result.infos, tables)          # [steps] modelled ms of each step
  >>> figures(result.infos, tables, emitted=result.stats["emitted"])["tokens_per_s"]
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from av_jax.costs import CostTables

VERIFY_CHARGES = ("tokens", "bucket")


class ClockRecord(NamedTuple):
  """The StepInfo fields the modelled clock reads, host numpy, one entry per step."""
  active: np.ndarray        # [S] int32, active requests of the step
  verified: np.ndarray      # [S] int32, draft tokens verified (oracle: accepted only)
  bucket: np.ndarray        # [S] int32, packed bucket index the engine ran
  draft_passes: np.ndarray  # [S] int32, drafter passes run
  emitted: np.ndarray       # [S] int32, tokens emitted
  # [S] int32, requests that drafted (sum of StepInfo.draft_slots); None: a record made
  # before per-slot drafting, where every active request drafted
  draft_requests: np.ndarray | None = None


def step_fields(info) -> tuple:
  """The `ClockRecord` fields of one `StepInfo` (device arrays, stacked over steps), in
  order: what a run keeps per chunk for the modelled clock (a few ints per step)."""
  return tuple(getattr(info, name) for name in ClockRecord._fields[:-1]) + (
      info.draft_slots.sum(axis=-1),)


def record(infos) -> ClockRecord:
  """A `ClockRecord` from one `StepInfo` (stacked over steps) or a list of them (chunks)."""
  if not isinstance(infos, (list, tuple)) or hasattr(infos, "_fields"):
    infos = [infos]
  cat = lambda values: np.concatenate([np.atleast_1d(np.asarray(v)) for v in values]
                                      ).astype(np.int64) if infos else np.zeros((0,), np.int64)
  fields = [cat([getattr(i, name) for i in infos]) for name in ClockRecord._fields[:-1]]
  if all(getattr(i, "draft_slots", None) is not None for i in infos):
    requests = cat([np.sum(np.asarray(i.draft_slots), axis=-1) for i in infos])
  else:
    requests = None
  return ClockRecord(*fields, requests)


def _draft_requests(rec: ClockRecord) -> np.ndarray:
  """`[S]` the requests each step drafted for (old records: its active requests)."""
  if rec.draft_requests is None:
    return np.asarray(rec.active, np.int64)
  return np.asarray(rec.draft_requests, np.int64)


def step_ms(infos, tables: CostTables, *, verify: str = "tokens",
            engine_buckets: Sequence[int] | None = None) -> np.ndarray:
  """`[S]` modelled milliseconds of every step (see the module docstring).

  Args:
    infos: `StepInfo` records (one stacked chunk, a list of chunks, or a `ClockRecord`).
    tables: the deployment's cost tables; rows of `draft_depth_ms` must cover the
      active requests and its depths the passes run.
    verify: "tokens" (the verified tokens' cost) or "bucket" (the engine's bucket's).
    engine_buckets: the engine's bucket sizes (`engine.buckets`); with "bucket" they
      must be `tables.buckets` (or their prefix: the tables may add the top bucket).

  Raises:
    ValueError: an unknown `verify`, or tables that do not cover what the steps did.
  """
  rec = infos if isinstance(infos, ClockRecord) else record(infos)
  if verify not in VERIFY_CHARGES:
    raise ValueError(f"verify: expected one of {VERIFY_CHARGES}, got {verify!r}")
  depth = np.asarray(tables.draft_depth_ms, np.float64)
  rows, depths = depth.shape
  drafting = _draft_requests(rec)
  if rec.active.size and max(rec.active.max(), drafting.max()) >= rows:
    raise ValueError(f"tables: draft_depth_ms has rows for R <= {rows - 1} requests, the "
                     f"steps ran {int(max(rec.active.max(), drafting.max()))}")
  if rec.draft_passes.size and rec.draft_passes.max() > depths:
    raise ValueError(f"tables: draft_depth_ms has {depths} depths, the steps ran "
                     f"{int(rec.draft_passes.max())} drafter passes")
  # Prefix sums along depth: cum[R, d] = draft_depth_ms[R, :d].sum().
  cum = np.concatenate([np.zeros((rows, 1)), np.cumsum(depth, axis=1)], axis=1)
  draft = cum[drafting, rec.draft_passes]
  if verify == "tokens":
    table = np.asarray(tables.cost.verify_ms, np.float64)
    tokens = rec.active + rec.verified
    if tokens.size and tokens.max() >= table.shape[0]:
      raise ValueError(f"tables: verify_ms covers T <= {table.shape[0] - 1} tokens, a step "
                       f"verified {int(tokens.max())}")
    check = table[tokens]
  else:
    # `roofline_costs(buckets=...)` appends the top bucket B (K + 1) when it is missing
    # (a target-only engine has only B), so the engine's buckets must be a prefix.
    n = 0 if engine_buckets is None else len(engine_buckets)
    if engine_buckets is not None and tuple(engine_buckets) != tuple(tables.buckets)[:n]:
      raise ValueError(f"tables: buckets {tuple(tables.buckets)} are not the engine's "
                       f"{tuple(engine_buckets)}; build them with buckets=engine.buckets")
    check = np.asarray(tables.bucket_ms, np.float64)[rec.bucket]
  return np.where(rec.active > 0, draft + check, 0.0)


def figures(infos, tables: CostTables, *, emitted: int | None = None,
            verify: str = "tokens", engine_buckets: Sequence[int] | None = None
            ) -> dict[str, float | str]:
  """Modelled throughput of a run: seconds, tokens/s, per-request tokens/s, the label.

  Per-request tokens/s is tokens/s divided by the mean number of active requests over
  the charged steps (the wall-clock figures of `av_lab.compare` use the same rule). The
  `steady_*` figures count only the steps with every slot busy (the most active requests
  of the run): the run before its final drain, whose length the slowest request sets
  whatever the arm.

  Args:
    infos: the run's `StepInfo` records.
    tables: the deployment's cost tables.
    emitted: tokens the run emitted (default: the records' sum).
    verify, engine_buckets: as in `step_ms`.
  """
  rec = infos if isinstance(infos, ClockRecord) else record(infos)
  ms = step_ms(rec, tables, verify=verify, engine_buckets=engine_buckets)
  tokens = int(rec.emitted.sum()) if emitted is None else int(emitted)
  busy = rec.active > 0
  seconds = float(ms.sum()) / 1e3
  mean_active = float(rec.active[busy].mean()) if busy.any() else 1.0
  tok_s = tokens / seconds if seconds > 0 else 0.0
  # Steady state: the steps with every slot busy (the most active requests of the run),
  # before the final drain, whose length the slowest request sets.
  full = busy & (rec.active == rec.active.max()) if busy.any() else busy
  full_s = float(ms[full].sum()) / 1e3
  steady = float(rec.emitted[full].sum()) / full_s if full_s > 0 else 0.0
  return dict(label=tables.label, verify=verify, seconds=seconds, steps=int(busy.sum()),
              tokens=tokens, tokens_per_s=tok_s,
              per_request_tokens_per_s=tok_s / mean_active,
              mean_step_ms=float(ms[busy].mean()) if busy.any() else 0.0,
              steady_steps=int(full.sum()), steady_tokens_per_s=steady,
              steady_per_request_tokens_per_s=(steady / float(rec.active.max())
                                               if full.any() else 0.0))


def summary_line(modelled: Mapping[str, float | str]) -> str:
  """One printable line of `figures`' result, labelled."""
  return (f"{modelled['tokens_per_s']:.1f} tok/s, {modelled['per_request_tokens_per_s']:.1f} "
          f"tok/s per request ({modelled['label']})")
