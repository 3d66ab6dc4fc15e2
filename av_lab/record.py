"""Recorded draft streams: what the shipped models draft and how much the target accepts.

`record` decodes held-out prompts of one workload with the engine under full verification
(every slot drafts and verifies all K positions, `fixed` arm) and keeps, per request and
decode step, what the replay (`av_lab.replay`) needs to re-run any decision on the stream:

* `features [S, K]`: the shipped feature (log-odds of the draft's top token) at every depth;
* `accepted [S]`: drafts accepted under full verification (0..K);
* `accept_probs [S, K]`: min(1, p(x) / q(x)) of every draft given its draft prefix, the
  probability the target accepts it once the positions before it are accepted.

Example: a request whose step 3 row reads `features = [2.1, 0.4, -1.0, ...]`,
`accepted = 1`, `accept_probs = [0.97, 0.35, ...]` had its first draft accepted and its
second rejected at that step; a replayed decision that verifies one draft there emits two
tokens, one that verifies none emits one.

Streams are saved as one `.npz` per (drafter, workload): the rows of all requests
concatenated, `offsets [N + 1]` marking each request's steps.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from av_jax import engine as E
from av_jax import models as M
from av_jax.sampling import Sampling
from av_lab.compare import workload_prompts

STREAMS_DIR = os.path.join(os.path.dirname(__file__), "streams")


@dataclasses.dataclass
class Streams:
  """The recorded draft streams of one (drafter, workload): N requests, S_n steps each."""
  features: np.ndarray      # [sum S_n, K] float16, logit_qmax at every depth
  accepted: np.ndarray      # [sum S_n] int8, drafts accepted under full verification
  accept_probs: np.ndarray  # [sum S_n, K] float16, min(1, p/q) given the draft prefix
  offsets: np.ndarray       # [N + 1] int64, request n's rows are offsets[n]:offsets[n+1]
  drafter: str              # drafter kind (block, eagle, draft_lm, ...)
  workload: str             # workload name
  meta: dict                # how it was recorded (slots, K, temperature, ...)

  @property
  def num_requests(self) -> int:
    return len(self.offsets) - 1

  @property
  def max_draft(self) -> int:
    return int(self.features.shape[1])

  def steps(self) -> np.ndarray:
    """`[N]` recorded steps of each request."""
    return np.diff(self.offsets)


def path_for(drafter: str, workload: str, directory: str | None = None) -> str:
  return os.path.join(directory or STREAMS_DIR, f"{drafter}_{workload}.npz")


def save(streams: Streams, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  np.savez_compressed(path, features=streams.features, accepted=streams.accepted,
                      accept_probs=streams.accept_probs, offsets=streams.offsets,
                      drafter=streams.drafter, workload=streams.workload,
                      meta=np.asarray(repr(sorted(streams.meta.items()))))


def load(drafter: str, workload: str, directory: str | None = None) -> Streams:
  """The shipped (or `directory`'s) streams of `drafter` on `workload`."""
  path = path_for(drafter, workload, directory)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no recorded streams for drafter={drafter!r}, workload="
                            f"{workload!r} at {path}: run `python -m av_lab.record`")
  with np.load(path) as z:
    meta = dict(eval(str(z["meta"]), {}))  # written by `save` from a dict of plain values
    return Streams(features=z["features"], accepted=z["accepted"],
                   accept_probs=z["accept_probs"], offsets=z["offsets"],
                   drafter=str(z["drafter"]), workload=str(z["workload"]), meta=meta)


def record(drafter: str, workload: str, *, num_requests: int = 48, slots: int = 16,
           max_draft: int = 8, max_new: int = 256, prompt_len: int = 32,
           temperature: float = 1.0, top_p: float = 0.95, seed: int = 0,
           models: str = "default", log=print) -> Streams:
  """Decodes `num_requests` held-out prompts of `workload` under full verification.

  Args:
    drafter: drafter kind of the shipped model set (block, eagle, draft_lm, block_head).
    workload: a registered workload (code, prose, math, noisy).
    num_requests: prompts decoded (each one request of `max_new` tokens).
    slots: concurrency of the recording engine (does not change what is recorded).
    max_draft: K, depths drafted and verified every step.
    max_new: tokens per request; a request records one row per decode step.
    prompt_len, temperature, top_p, seed: the prompts and sampling.
    models: the shipped model set.
    log: progress lines.

  Returns:
    The `Streams`, one request per prompt, in prompt order of completion.
  """
  pair = M.load(models, drafter=drafter)
  config = E.EngineConfig(num_slots=slots, max_draft=max_draft,
                          max_len=prompt_len + max_new + max_draft + 8, mode="fixed",
                          eos_id=-1, sampling=Sampling(temperature=temperature, top_p=top_p),
                          programs=E.Programs(steps_per_chunk=1, record_features=True))
  engine = E.make_engine(config, pair.cfg, pair.drafter)
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  prompts = workload_prompts(pair, workload, num=num_requests, length=prompt_len, seed=seed)
  rows = [[] for _ in range(slots)]  # the current request's rows, per slot
  done: list[list] = []
  start = time.perf_counter()

  def on_chunk(state, info):
    active_after = np.asarray(state.active)
    feats, probs = np.asarray(info.features), np.asarray(info.accept_probs)
    acc = np.asarray(info.accepted).sum(axis=-1)
    was = np.asarray(info.slot_active)
    for s in range(feats.shape[0]):
      for b in np.nonzero(was[s])[0]:
        rows[b].append((feats[s, b], acc[s, b], probs[s, b]))
    for b in range(slots):
      if rows[b] and not active_after[b]:
        done.append(rows[b])
        rows[b] = []
        if len(done) % 8 == 0:
          log(f"  {drafter}/{workload}: {len(done)}/{num_requests} requests "
              f"({time.perf_counter() - start:.0f} s)")

  E.generate(engine, params, prompts, max_new_tokens=max_new,
             key=jax.random.PRNGKey(seed), on_chunk=on_chunk)
  steps = np.asarray([len(r) for r in done])
  flat = [row for r in done for row in r]
  return Streams(
      features=np.stack([f for f, _, _ in flat]).astype(np.float16),
      accepted=np.asarray([a for _, a, _ in flat], np.int8),
      accept_probs=np.stack([p for _, _, p in flat]).astype(np.float16),
      offsets=np.concatenate([[0], np.cumsum(steps)]).astype(np.int64),
      drafter=drafter, workload=workload,
      meta=dict(models=models, slots=slots, max_draft=max_draft, max_new=max_new,
                prompt_len=prompt_len, temperature=temperature, top_p=top_p, seed=seed,
                seconds=round(time.perf_counter() - start, 1)))


def main(argv=None) -> None:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--drafters", default="block,eagle,draft_lm")
  parser.add_argument("--workloads", default="code,prose,math,noisy")
  parser.add_argument("--requests", type=int, default=48)
  parser.add_argument("--max-new", type=int, default=256)
  parser.add_argument("--out", default=STREAMS_DIR)
  parser.add_argument("--skip-existing", action="store_true")
  args = parser.parse_args(argv)
  for drafter in args.drafters.split(","):
    for workload in args.workloads.split(","):
      path = path_for(drafter, workload, args.out)
      if args.skip_existing and os.path.exists(path):
        continue
      streams = record(drafter, workload, num_requests=args.requests, max_new=args.max_new)
      save(streams, path)
      print(f"{path}: {streams.num_requests} requests, {int(streams.steps().sum())} steps, "
            f"mean accepted {streams.accepted.mean():.2f}, {streams.meta['seconds']} s",
            flush=True)


if __name__ == "__main__":
  main()
