"""The full, seeded training pipeline of a model set: tokenizer, target, drafters, head."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.data import workloads
from av_jax.data.tokenizer import from_json, train_tokenizer
from av_jax.models import checkpoint, evaluate, train, transformer
from av_jax.models.config import ModelsConfig, config_hash, to_dict
from av_jax.models.drafters import init_drafter_params, make_drafter


def _tokenizer_texts(cfg: ModelsConfig):
  for name in workloads.list_workloads():
    used = 0
    for doc in workloads.documents(name, "train", config=cfg.data):
      if used >= cfg.tokenizer_chars:
        break
      yield doc.text
      used += len(doc.text)


def num_params(params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def heldout_windows(cfg: ModelsConfig, tokenizer, name: str) -> np.ndarray:
  """The fixed held-out windows `[N, S+1]` of workload `name` the held-out loss is taken on."""
  stream = workloads.token_stream(name, "heldout", tokenizer=tokenizer, config=cfg.data)
  rng = np.random.default_rng([cfg.seed, 7, workloads.list_workloads().index(name)])
  return workloads.sample_windows(stream, rng, num=cfg.measure.eval_windows,
                                  length=cfg.train_target.seq_len + 1)


def heldout_losses(params, cfg: ModelsConfig, tokenizer) -> dict[str, float]:
  return {n: evaluate.heldout_loss(params, heldout_windows(cfg, tokenizer, n), cfg=cfg.target,
                                   batch=min(16, cfg.measure.eval_windows))
          for n in workloads.list_workloads()}


def collect_head_labels(cfg: ModelsConfig, tokenizer, target_params, block_params, *,
                        split: str, seed: int):
  """Runs verification with the block drafter (T=1, top-p from `measure`) to get labels."""
  hc = cfg.train_head
  drafter = make_drafter("block", cfg)
  out = {"hidden": [], "token": [], "labels": [], "mask": []}
  for i, name in enumerate(workloads.list_workloads()):
    prompts = workloads.prompts(name, tokenizer=tokenizer, num=hc.num_prompts,
                                length=hc.prompt_len, seed=seed, split=split,
                                config=cfg.data)
    rec = evaluate.rollout(target_params, block_params, jnp.asarray(prompts),
                           jax.random.key(seed * 100 + i), cfg=cfg, drafter=drafter,
                           K=cfg.block.block_size, steps=hc.steps, temperature=1.0,
                           top_p=cfg.measure.top_p)
    d = rec.ctx_hidden.shape[-1]
    out["hidden"].append(np.asarray(rec.ctx_hidden).reshape(-1, d))
    out["token"].append(np.asarray(rec.ctx_token).reshape(-1))
    out["labels"].append(np.asarray(rec.accepted).reshape(-1, cfg.block.block_size))
    out["mask"].append(np.asarray(rec.labeled).reshape(-1, cfg.block.block_size))
  return {k: np.concatenate(v) for k, v in out.items()}


DRAFTER_ORDER = ("draft_lm", "eagle", "block")  # order of the drafters' init keys


def default_work_dir(name: str) -> str:
  """Where `train_all` keeps its resumable training state for model set `name`."""
  root = os.environ.get("AV_JAX_TRAIN_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "av_jax", "train")
  return os.path.join(root, name)


def train_all(cfg: ModelsConfig, out_dir: str, *, progress: bool = True, log=print,
              only: tuple[str, ...] | None = None, work_dir: str | None = None,
              resume: bool = False, checkpoint_every_s: float = 600.0) -> dict[str, Any]:
  """Trains every model of `cfg` and writes tokenizer, checkpoints and a summary to `out_dir`.

  Args:
    cfg: the model set config.
    out_dir: output directory.
    progress: show tqdm bars.
    log: where progress lines go.
    only: retrain just these drafter kinds, reusing the tokenizer and target already in
      `out_dir` (every drafter has its own init key, batches and clipping, so this is a
      full run's recipe for them, equal up to float reassociation). `block_head` needs
      `block` (retrained or on disk).

    work_dir: resumable training state (tokenizer, orbax checkpoints of parameters and
      optimiser state of the target and the drafters); default `default_work_dir`.
    resume: continue from the state in `work_dir` (a stopped run loses at most
      `checkpoint_every_s` of training). Without it, an existing state is refused rather
      than overwritten.
    checkpoint_every_s: wall seconds between training checkpoints.

  Returns:
    The summary (also written to `{out_dir}/{cfg.name}_summary.json`).
  """
  work_dir = _open_work_dir(cfg, work_dir or default_work_dir(cfg.name), resume)
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.time()
  timings = {}

  t0 = time.time()
  tokenizer, tok_json = _tokenizer(cfg, out_dir, work_dir, only)
  streams = {n: workloads.token_stream(n, "train", tokenizer=tokenizer, config=cfg.data)
             for n in workloads.list_workloads()}
  timings["tokenizer_and_data_s"] = time.time() - t0
  log(f"tokenizer: {tokenizer.vocab_size} tokens; train tokens per workload: "
      f"{ {n: len(s) for n, s in streams.items()} }")

  batches = functools.partial(_batches, cfg, streams)
  k_target, k_drafters, _ = jax.random.split(jax.random.key(cfg.seed), 3)
  fit_args = dict(disable_bar=not progress, log=log)
  ckpt = lambda name: train.TrainingCheckpoint(os.path.join(work_dir, name),
                                               checkpoint_every_s)
  t0 = time.time()
  target_params, target_hist = _train_target(cfg, out_dir, only, k_target,
                                             batches(cfg.train_target, 1), ckpt, fit_args)
  if not only:
    timings["target_s"] = time.time() - t0
  losses = heldout_losses(target_params, cfg, tokenizer)
  log(f"target held-out loss: { {k: round(v, 4) for k, v in losses.items()} }")
  save_part = functools.partial(_save_part, cfg, out_dir, checkpoint.tokenizer_hash(tok_json),
                                losses)
  if not only:
    save_part("target", target_params)  # early, so a later failure keeps the target

  t0 = time.time()
  dparams, drafter_hist = _train_drafters(cfg, only, k_drafters, target_params,
                                          batches(cfg.train_drafters, 2), ckpt, fit_args)
  timings["drafters_s"] = time.time() - t0
  t0 = time.time()
  num_labels = 0
  if not only or "block_head" in only:
    dparams["block_head"], num_labels = _train_head(cfg, out_dir, tokenizer, target_params,
                                                    dparams)
  timings["head_s"] = time.time() - t0
  sizes, counts = {}, {}
  for part, p in ([] if only else [("target", target_params)]) + list(dparams.items()):
    sizes[part] = save_part(part, p)
    counts[part] = num_params(p)
  timings["total_s"] = time.time() - t_start
  summary = {
      "name": cfg.name, "heldout_loss": losses, "num_params": counts, "bytes": sizes,
      "timings": timings, "head_labels": num_labels,
      "final_train_loss": {"target": target_hist[-1][1], "drafters": drafter_hist[-1][1]},
      "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(),
  }
  return _write_summary(os.path.join(out_dir, f"{cfg.name}_summary.json"), summary, only,
                        timings, num_labels, tok_json)


def _batches(cfg: ModelsConfig, streams, tc, salt: int):
  """Batch `i -> [batch, seq_len + 1]` tokens of the mixed training streams (seeded)."""
  return lambda i: jnp.asarray(workloads.mixed_batch(
      streams, np.random.default_rng([cfg.seed, salt, i]), batch=tc.batch,
      length=tc.seq_len + 1))


def _train_target(cfg: ModelsConfig, out_dir: str, only, key, batches, ckpt, fit_args):
  """(target parameters, loss history): trained, or read from `out_dir` under `only`."""
  if only:
    return jax.tree.map(jnp.asarray, checkpoint.read(
        checkpoint.path_of(out_dir, cfg.name, "target")).params), [(0, float("nan"))]
  params = transformer.init_params(cfg.target, key)
  params, hist = train.fit(
      lambda p, b: train.target_loss(p, b, cfg=cfg), params, cfg.train_target, batches,
      desc="target", checkpoint=ckpt("target"), flops_per_token=6.0 * num_params(params),
      **fit_args)
  return jax.tree.map(jnp.asarray, checkpoint.round_params(params)), hist


def _train_drafters(cfg: ModelsConfig, only, key, target_params, batches, ckpt, fit_args):
  """({kind: parameters}, loss history) of the drafters (those in `only`, else all),
  distilled jointly from the target (one teacher forward per batch)."""
  keys = dict(zip(DRAFTER_ORDER, jax.random.split(key, 3)))
  kinds = [k for k in DRAFTER_ORDER if not only or k in only]
  dparams = {kind: init_drafter_params(kind, cfg, keys[kind]) for kind in kinds}
  if not dparams:
    return dparams, [(0, float("nan"))]
  dparams, hist = train.fit(
      lambda p, b: train.drafter_losses(p, target_params, b, cfg=cfg), dparams,
      cfg.train_drafters, batches, desc="drafters",
      optimizer=train.make_per_model_optimizer(cfg.train_drafters),
      checkpoint=ckpt("drafters_" + "_".join(kinds)),
      # a teacher forward (2N) plus the drafters' forward and backward (6N each)
      flops_per_token=2.0 * num_params(target_params) + 6.0 * num_params(dparams),
      **fit_args)
  return jax.tree.map(jnp.asarray, checkpoint.round_params(dparams)), hist


def _open_work_dir(cfg: ModelsConfig, work_dir: str, resume: bool) -> str:
  """`work_dir`, created, holding `cfg`; refuses to overwrite a run without `resume`, or
  to resume a run of another config."""
  if not resume and os.path.isdir(work_dir) and os.listdir(work_dir):
    raise ValueError(f"work_dir: {work_dir} already holds a training run of {cfg.name!r}; "
                     "pass resume=True (--resume) to continue it, or delete the folder")
  os.makedirs(work_dir, exist_ok=True)
  cfg_path = os.path.join(work_dir, "config.json")
  if resume and os.path.exists(cfg_path):
    with open(cfg_path, encoding="utf-8") as f:
      if json.load(f) != json.loads(json.dumps(to_dict(cfg))):
        raise ValueError(f"resume: {work_dir} holds a run of another config than "
                         f"{cfg.name!r} as it is now; delete the folder to start over")
  with open(cfg_path, "w", encoding="utf-8") as f:
    json.dump(to_dict(cfg), f, indent=1, sort_keys=True)
  return work_dir


def _tokenizer(cfg: ModelsConfig, out_dir: str, work_dir: str, only):
  """(tokenizer, its JSON): the one in `out_dir` (`only`) or `work_dir` (a resumed run
  keeps the tokenizer it started with), else a new one trained and written to both."""
  tok_path = os.path.join(out_dir, f"tokenizer_{cfg.name}.json")
  work_tok = os.path.join(work_dir, "tokenizer.json")
  if only or os.path.exists(work_tok):
    with open(tok_path if only else work_tok, encoding="utf-8") as f:
      tok_json = f.read()
    tokenizer = from_json(tok_json)
    if not only:
      with open(tok_path, "w", encoding="utf-8") as f:
        f.write(tok_json)
  else:
    tokenizer = train_tokenizer(_tokenizer_texts(cfg), vocab_size=cfg.tokenizer_vocab)
    tok_json = tokenizer.to_json()
    for path in (tok_path, work_tok):
      with open(path, "w", encoding="utf-8") as f:
        f.write(tok_json)
  if tokenizer.vocab_size != cfg.target.vocab_size:
    raise ValueError(f"tokenizer learnt {tokenizer.vocab_size} tokens, config says "
                     f"{cfg.target.vocab_size}; lower tokenizer_vocab or add text")
  return tokenizer, tok_json


def _save_part(cfg: ModelsConfig, out_dir: str, tok_hash: str, losses: dict, part: str,
               params) -> int:
  """Writes one model's checkpoint with its metadata; returns its size in bytes."""
  meta = {"config": to_dict(cfg), "config_hash": config_hash(cfg, part),
          "tokenizer_hash": tok_hash, "part": part}
  if part == "target":
    meta["heldout_loss"] = losses
  return checkpoint.save(checkpoint.path_of(out_dir, cfg.name, part), params, meta)


def _train_head(cfg: ModelsConfig, out_dir: str, tokenizer, target_params, dparams):
  """(confidence-head parameters, labels used): fitted on labels from verification of
  train-split prompts, over the block drafter just trained (or the one on disk)."""
  block = dparams["block"] if "block" in dparams else jax.tree.map(
      jnp.asarray, checkpoint.read(checkpoint.path_of(out_dir, cfg.name, "block")).params)
  labels = collect_head_labels(cfg, tokenizer, target_params, block, split="train",
                               seed=cfg.seed)
  head_params = train.fit_confidence_head(
      block, target_params, labels["hidden"], labels["token"], labels["labels"],
      labels["mask"], cfg=cfg, steps=cfg.train_head.train_steps, lr=cfg.train_head.lr,
      batch=cfg.train_head.batch, seed=cfg.seed)
  return (jax.tree.map(jnp.asarray, checkpoint.round_params(head_params)),
          int(labels["mask"].sum()))


def _write_summary(path: str, summary: dict, only, timings: dict, num_labels: int,
                   tok_json: str) -> dict:
  """Writes the run's summary to `path` (a partial run's merged into the full run's
  summary there) and returns it."""
  if only:
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    for k in ("num_params", "bytes"):
      summary[k] = {**old[k], **summary[k]}
    summary["timings"] = old["timings"]
    summary["retrained"] = {**old.get("retrained", {}),
                            ",".join(only): {k: round(v, 1) for k, v in timings.items()}}
    summary["head_labels"] = num_labels or old["head_labels"]
    summary["final_train_loss"] = old["final_train_loss"]
  summary["total_bytes"] = int(sum(summary["bytes"].values()) + len(tok_json.encode()))
  with open(path, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  return summary
