"""Labelled drafts and online coefficient traces from real engine runs (studies 1 and 4).

`collect` decodes a prompt stream with the engine in `fixed` mode (every slot verifies all
K drafts) and `programs.record_features=True`, and flattens the per-step records into one row per
labelled draft token: every registered feature, the position, the label, the online
estimator's served prediction, the confidence-head score, and the step. The estimator
runs (and refits) during the stream exactly as it would while serving, so its served
predictions are an honest out-of-sample score; its coefficients are snapshotted after
every chunk.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import jax
import numpy as np

from av_jax import engine as E
from av_jax.engine import core
from av_jax.estimator import EstimatorConfig
from av_jax.sampling import Sampling

FEATURE_NAMES = core.RECORDED_FEATURES


@dataclasses.dataclass
class Drafts:
  """Labelled draft tokens, one row each (numpy arrays of equal length N)."""
  features: np.ndarray   # [N, F] float32, FEATURE_NAMES
  position: np.ndarray   # [N] int32, draft position 0..K-1 (position 1 in the note = 0)
  label: np.ndarray      # [N] bool, accepted
  served: np.ndarray     # [N] float32, online estimator's prediction when drafted
  conf: np.ndarray       # [N] float32, confidence-head probability (0 without a head)
  step: np.ndarray       # [N] int32, decode step of the stream (ordering)
  segment: np.ndarray    # [N] int32, stream segment (workload switches; 0 when none)

  def __len__(self) -> int:
    return int(self.label.shape[0])

  def feature(self, name: str) -> np.ndarray:
    return self.features[:, FEATURE_NAMES.index(name)]

  def take(self, index) -> "Drafts":
    return Drafts(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

  @staticmethod
  def concat(parts: Sequence["Drafts"]) -> "Drafts":
    return Drafts(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                     for f in dataclasses.fields(Drafts)})


@dataclasses.dataclass
class Trace:
  """Online estimator coefficients after every chunk."""
  step: np.ndarray         # [C] int32, decode steps run when snapshotted
  slope: np.ndarray        # [C] float32
  intercepts: np.ndarray   # [C, K] float32
  num_refits: np.ndarray   # [C] int32
  segment: np.ndarray      # [C] int32


@dataclasses.dataclass
class Stream:
  drafts: Drafts
  trace: Trace
  seconds: float


def flatten(infos: Sequence[core.StepInfo], *, first_step: int = 0,
            segment: int = 0) -> Drafts:
  """One row per labelled draft token of per-chunk step records (host numpy)."""
  parts = []
  step = first_step
  for info in infos:
    S, B, K = info.labeled.shape
    if info.extra.shape[-1] != len(FEATURE_NAMES):
      raise ValueError("infos: expected records of an engine with programs.record_features=True, "
                       f"got {info.extra.shape[-1]} features per draft")
    s, _, k = np.nonzero(info.labeled)
    parts.append(Drafts(
        features=info.extra[info.labeled].astype(np.float32),
        position=k.astype(np.int32),
        label=info.accepted[info.labeled],
        served=info.probs[info.labeled].astype(np.float32),
        conf=info.conf[info.labeled].astype(np.float32),
        step=(step + s).astype(np.int32),
        segment=np.full(s.shape, segment, np.int32)))
    step += S
  if not parts:
    raise ValueError("infos: no step records to flatten")
  return Drafts.concat(parts)


def study_config(*, slots: int, max_draft: int, max_len: int, temperature: float,
                 top_p: float, refit_interval: int, mode: str = "fixed",
                 steps_per_chunk: int = 8) -> E.EngineConfig:
  return E.EngineConfig(num_slots=slots, max_draft=max_draft, max_len=max_len, mode=mode,
                        eos_id=-1, sampling=Sampling(temperature=temperature, top_p=top_p),
                        estimator=EstimatorConfig(refit_interval=refit_interval),
                        programs=E.Programs(steps_per_chunk=steps_per_chunk,
                                            record_features=True))


def collect(engine: core.Engine, params: core.Params,
            segments: Sequence[Sequence[Sequence[int]]], *, steps: int, max_new: int,
            key: jax.Array, progress=None) -> Stream:
  """Decodes `segments` one after the other, `steps` decode steps each, with one state.

  Each segment is a prompt list; its requests are served with continuous batching and
  the segment ends after `steps` steps (rounded up to whole chunks) — requests still in
  flight are dropped, so every slot is busy for the whole segment when there are enough
  prompts. The estimator carries over between segments (a workload switch mid-stream).

  Args:
    engine: an engine with `programs.record_features=True` (see `study_config`).
    params: model parameters.
    segments: prompt lists, one per segment.
    steps: decode steps per segment.
    max_new: output limit per request.
    key: PRNG key of the stream.
    progress: optional callable(n) advanced by the steps run (a tqdm bar's `update`).

  Returns:
    The labelled drafts (with `segment` set) and the coefficient trace.
  """
  if not engine.config.programs.record_features:
    raise ValueError("engine: expected a config with programs.record_features=True")
  chunk_steps = engine.config.programs.steps_per_chunk
  num_chunks = max(1, math.ceil(steps / chunk_steps))
  state = None
  drafts, trace = [], []
  done_steps = 0
  start = time.perf_counter()
  for seg, prompts in enumerate(segments):
    infos = []

    def on_chunk(state, info, seg=seg):
      est = state.estimator
      infos.append(jax.tree.map(np.asarray, info))
      trace.append((int(state.stats.steps), np.asarray(est.slope),
                    np.asarray(est.intercepts), int(est.num_refits), seg))
      if progress is not None:
        progress(chunk_steps)

    result = E.generate(engine, params, list(prompts), max_new_tokens=max_new,
                        key=jax.random.fold_in(key, seg), state=state, on_chunk=on_chunk,
                        stop_after_chunks=num_chunks)
    drafts.append(flatten(infos, first_step=done_steps, segment=seg))
    done_steps += sum(i.labeled.shape[0] for i in infos)
    # Requests still in flight are dropped: the next segment starts from idle slots with
    # the estimator (and everything it learned) carried over.
    state = result.state._replace(active=np.zeros_like(np.asarray(result.state.active)))
  steps_, slope, intercepts, refits, segs = (np.asarray(x) for x in zip(*trace))
  return Stream(drafts=Drafts.concat(drafts),
                trace=Trace(step=steps_, slope=slope, intercepts=intercepts, num_refits=refits,
                            segment=segs),
                seconds=time.perf_counter() - start)

