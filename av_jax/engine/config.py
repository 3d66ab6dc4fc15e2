"""The engine's static settings: `EngineConfig` and its compiled-program layout, `Programs`.

One compiled program set per config. Every setting has one name, on the config that
holds it:

    EngineConfig(num_slots=8, max_draft=8, max_len=512, mode="av",
                 sampling=Sampling(temperature=0.0),
                 estimator=EstimatorConfig(refit_interval=100),
                 programs=Programs(num_buckets=4))

Both are frozen, keyword-only dataclasses (hashable, so an `Engine` holding one is a
static argument of `jax.jit`); change a setting with `dataclasses.replace`, on the nested
config for a nested setting.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from av_jax.arms import ARMS, get_arm
from av_jax.estimator import EstimatorConfig
from av_jax.planner import POLICIES
from av_jax.sampling import Sampling


def _is_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _check_int(name: str, value, least: int) -> None:
  if not _is_int(value) or value < least:
    raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")


def _check_sizes(name: str, value) -> tuple[int, ...] | None:
  """`value` as a tuple of ints >= 1 (None stays None); a list is accepted."""
  if value is None:
    return None
  if (not isinstance(value, (tuple, list)) or not value
      or any(not _is_int(v) or v < 1 for v in value)):
    raise ValueError(f"{name}: expected None or a non-empty tuple of ints >= 1, got "
                     f"{value!r}")
  return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Programs:
  """How the engine's work is laid out in compiled programs (`EngineConfig.programs`).

  Buckets T: a step verifies its packed tokens in the smallest bucket that holds them, one
  `lax.switch` branch per bucket. Draft buckets E: a step on which n slots draft gathers
  them into the smallest E >= n drafter rows. Drafter backlog P: a slot of an
  autoregressive drafter that skips drafting keeps up to P committed tokens and their
  target hidden states pending (B x P hidden states in memory), absorbed when it drafts
  again or when P are pending (`drafters.widen` / `settle`). Sizes are checked against the
  engine's slots and draft length by `EngineConfig`.
  """
  # Number of packed-token sizes T, spaced geometrically from B to B(K+1).
  num_buckets: int = 4
  # Explicit packed-token sizes T, instead of num_buckets (B(K+1) is appended if above them).
  buckets: tuple[int, ...] | None = None
  # Drafter row counts E a gated step gathers its drafting slots into; None: B/8, B/4, B/2, B.
  draft_buckets: tuple[int, ...] | None = None
  # Committed tokens a slot that skips drafting keeps pending (>= K + 1); None: 4 (K + 1).
  drafter_backlog: int | None = None
  # G, slot groups verified as separate packs; None: 1, or under a mesh its 'data' size.
  verify_groups: int | None = None
  # Steps on which no slot drafts run in a target-only program of their own.
  quiet_program: bool = True
  # Decode steps per `run_chunk` (the host syncs between chunks).
  steps_per_chunk: int = 16
  # StepInfo.extra and accept_probs hold every `drafting.RECORDED_FEATURES` (studies).
  record_features: bool = False

  def __post_init__(self):
    _check_int("num_buckets", self.num_buckets, 1)
    object.__setattr__(self, "buckets", _check_sizes("buckets", self.buckets))
    object.__setattr__(self, "draft_buckets",
                       _check_sizes("draft_buckets", self.draft_buckets))
    if self.drafter_backlog is not None:
      _check_int("drafter_backlog", self.drafter_backlog, 1)
    if self.verify_groups is not None:
      _check_int("verify_groups", self.verify_groups, 1)
    _check_int("steps_per_chunk", self.steps_per_chunk, 1)
    for name in ("quiet_program", "record_features"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Static engine settings: shapes, the arm, and the nested sampling, estimator and
  program-layout configs."""
  num_slots: int = 8             # B, concurrent request slots
  max_draft: int = 8             # K, maximum draft length
  max_len: int = 512             # M, cache positions per slot (prompt + output + K + 1)
  mode: str = "av"               # the arm, one of `av_jax.arms.ARMS` (or "confstop:T")
  policy: str | None = None      # planner budget policy; None: the exact one for the drafter
  eos_id: int = -1               # end-of-sequence token (-1: none)
  sampling: Sampling = Sampling()  # temperature (0: greedy) and top-p of draft and target
  estimator: EstimatorConfig = EstimatorConfig()  # the online estimator's settings
  programs: Programs = Programs()  # bucket sizes, verify groups and chunking of the programs

  def __post_init__(self):
    if not isinstance(self.mode, str):
      raise ValueError(f"mode: expected a str, got {self.mode!r}")
    try:
      get_arm(self.mode)
    except ValueError:
      raise ValueError(f"mode: expected one of {tuple(ARMS)} or confstop:T, got "
                       f"{self.mode!r}") from None
    if self.policy is not None and self.policy not in POLICIES:
      raise ValueError(f"policy: expected one of {POLICIES} or None, got {self.policy!r}")
    _check_int("num_slots", self.num_slots, 1)
    _check_int("max_draft", self.max_draft, 1)
    if not _is_int(self.max_len) or self.max_len < self.max_draft + 3:
      raise ValueError(f"max_len: expected an int >= max_draft + 3 = {self.max_draft + 3}, "
                       f"got {self.max_len!r}")
    if not _is_int(self.eos_id):
      raise ValueError(f"eos_id: expected an int (-1: none), got {self.eos_id!r}")
    for group, kind in (("sampling", Sampling), ("estimator", EstimatorConfig),
                        ("programs", Programs)):
      if not isinstance(getattr(self, group), kind):
        raise ValueError(f"{group}: expected a {kind.__name__}, got "
                         f"{getattr(self, group)!r}")
    p, B = self.programs, self.num_slots
    if p.verify_groups is not None:
      if B % p.verify_groups:
        raise ValueError(f"programs.verify_groups: expected a divisor of num_slots = {B}, "
                         f"got {p.verify_groups}")
      if p.buckets is not None and any(b % p.verify_groups for b in p.buckets):
        raise ValueError(f"programs.buckets: with verify_groups = {p.verify_groups} every "
                         f"size must be a multiple of it (G groups of T/G), got {p.buckets}")
    if p.draft_buckets is not None and max(p.draft_buckets) > B:
      raise ValueError(f"programs.draft_buckets: expected sizes in [1, num_slots = {B}], "
                       f"got {p.draft_buckets}")
    if p.drafter_backlog is not None and p.drafter_backlog < self.max_draft + 1:
      raise ValueError(f"programs.drafter_backlog: expected an int >= max_draft + 1 = "
                       f"{self.max_draft + 1} or None, got {p.drafter_backlog}")

  @property
  def groups(self) -> int:
    """G, the number of verify groups (`programs.verify_groups`, 1 when None)."""
    return self.programs.verify_groups or 1

  def pending_width(self) -> int:
    """P, the pending columns of a drafter state under lazy catch-up
    (`programs.drafter_backlog`, default 4 (K + 1))."""
    backlog = self.programs.drafter_backlog
    return 4 * (self.max_draft + 1) if backlog is None else int(backlog)

  def draft_bucket_sizes(self) -> tuple[int, ...]:
    """Draft bucket sizes E, ascending, the last B: a gated step drafting for n slots
    gathers them into the smallest E >= n rows (`programs.draft_buckets`, or the
    geometric ceil(B/8), ceil(B/4), ceil(B/2), B)."""
    B = self.num_slots
    if self.programs.draft_buckets is not None:
      sizes = set(self.programs.draft_buckets)
    else:
      sizes = {-(-B // d) for d in (8, 4, 2, 1)}
    return tuple(sorted(sizes | {B}))

  def bucket_sizes(self) -> tuple[int, ...]:
    """Packed-token sizes T of all groups together, ascending (G x `group_bucket_sizes`).

    The last holds every slot's K + 1 tokens. These are the sizes the cost tables and
    `StepInfo.bucket` refer to: a step verifying R + n tokens in all costs what bucket
    T >= R + n costs, which is exact for G = 1 and assumes the tokens spread evenly over
    the groups otherwise (the step really runs the bucket of its fullest group).
    """
    return tuple(self.groups * s for s in self.group_bucket_sizes())

  def group_bucket_sizes(self) -> tuple[int, ...]:
    """Per-group packed sizes T_g, ascending; the last holds B/G slots' K + 1 tokens."""
    G, K = self.groups, self.max_draft
    B = self.num_slots // G  # slots per group
    top = B * (K + 1)
    if self.programs.buckets is not None:
      # Multiples of G (checked at construction).
      sizes = tuple(s // G for s in sorted(set(self.programs.buckets)))
      return sizes if sizes[-1] >= top else sizes + (top,)
    if self.mode in ("target_only",):
      return (B,)
    if self.mode in ("fixed", "oracle"):
      return (top,)
    # Geometric spacing from B (target only) to B(K+1) (everything): a step's cost stays
    # within a constant factor of the tokens it verifies, with few compiled programs.
    n = self.programs.num_buckets
    sizes = np.unique(np.round(B * (K + 1) ** (np.arange(n) / max(n - 1, 1))).astype(int))
    return tuple(int(s) for s in sizes[:-1]) + (top,)
