"""Training: target pre-training, joint drafter distillation, confidence-head fitting.

Every model trains with AdamW under linear warm-up then cosine decay, on batches with an
equal share of windows from every workload's train split. Drafters are distilled from
the target at temperature 1 (cross-entropy against the target's full next-token
distribution); `eagle` also regresses the target's features. The confidence head of
`block_head` is a logistic regression on the frozen block drafter's per-position hidden
state, fit to accept/reject labels collected by running verification (`evaluate.rollout`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from av_jax.models import drafters as drafters_lib
from av_jax.models import transformer
from av_jax.models.config import ModelsConfig, TrainConfig


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW with linear warm-up and cosine decay to 5% of peak."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, tc.lr, warmup_steps=tc.warmup, decay_steps=max(tc.steps, tc.warmup + 1),
      end_value=0.05 * tc.lr)
  return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay))


def make_per_model_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """`make_optimizer` applied separately to every top-level entry of a dict of models.

  Clipping is per model, so models trained jointly (one teacher forward for all) get the
  same updates as if each were trained alone on the same batches.
  """
  def labels(params):
    return {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}

  def tx(params):
    return optax.multi_transform({k: make_optimizer(tc) for k in params}, labels)

  def init(params):
    return tx(params).init(params)

  def update(updates, state, params=None):
    return tx(updates).update(updates, state, params)

  return optax.GradientTransformation(init, update)


class TrainingCheckpoint(NamedTuple):
  """Where `fit` keeps its resumable state, and how often it writes it."""
  directory: str               # one folder per model being trained (created if missing)
  every_s: float = 600.0       # wall seconds between checkpoints (and one at the end)


def _latest(directory: str) -> tuple[int, str] | None:
  """`(step, path)` of the newest complete checkpoint in `directory`, or None."""
  pointer = os.path.join(directory, "latest.json")
  if not os.path.exists(pointer):
    return None
  with open(pointer, encoding="utf-8") as f:
    meta = json.load(f)
  path = os.path.join(directory, f"step_{meta['step']:08d}")
  return (meta["step"], path) if os.path.isdir(path) else None


def _save_training_state(ckpt: TrainingCheckpoint, step: int, params, opt_state,
                         history: list) -> None:
  """Writes the state after `step` optimiser steps, then moves the `latest` pointer.

  The pointer is replaced only after orbax has finished, so a stop mid-write leaves the
  previous checkpoint as the latest one; older checkpoints are then deleted.
  """
  os.makedirs(ckpt.directory, exist_ok=True)
  path = os.path.join(ckpt.directory, f"step_{step:08d}")
  if os.path.exists(path):
    shutil.rmtree(path)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.abspath(path), {"params": params, "opt_state": opt_state})
    ckptr.wait_until_finished()
  tmp = os.path.join(ckpt.directory, "latest.json.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"step": step, "history": history, "saved_at": time.time()}, f)
  os.replace(tmp, os.path.join(ckpt.directory, "latest.json"))
  for name in os.listdir(ckpt.directory):
    if name.startswith("step_") and name != os.path.basename(path):
      shutil.rmtree(os.path.join(ckpt.directory, name), ignore_errors=True)


def _restore_training_state(ckpt: TrainingCheckpoint, params, opt_state):
  """`(step, params, opt_state, history)` from the latest checkpoint, or None if there is none."""
  found = _latest(ckpt.directory)
  if found is None:
    return None
  step, path = found
  like = {"params": params, "opt_state": opt_state}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(os.path.abspath(path), abstract)
  with open(os.path.join(ckpt.directory, "latest.json"), encoding="utf-8") as f:
    history = [tuple(h) for h in json.load(f)["history"]]
  # orbax returns a plain-container tree: put it back into the optimiser's own structure.
  params = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(restored["params"]))
  opt_state = jax.tree.unflatten(jax.tree.structure(opt_state),
                                 jax.tree.leaves(restored["opt_state"]))
  return step, params, opt_state, history


@functools.lru_cache(maxsize=8)
def _train_step(loss_fn: Callable, opt: optax.GradientTransformation) -> Callable:
  """The jitted optimiser step (cached: a resumed `fit` with the same functions compiles once)."""

  @jax.jit
  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics

  return step


def fit(loss_fn: Callable, params, tc: TrainConfig, batch_fn: Callable, *, desc: str,
        disable_bar: bool = False, optimizer: optax.GradientTransformation | None = None,
        checkpoint: TrainingCheckpoint | None = None, stop_after: int | None = None,
        flops_per_token: float | None = None, log: Callable[[str], None] = print):
  """Runs `tc.steps` optimiser steps of `loss_fn(params, batch) -> (loss, metrics)`.

  Batches are a function of the step index only (`batch_fn(i)`), so a run that resumes
  from a checkpoint after step i sees exactly the batches an uninterrupted run sees.

  Args:
    loss_fn: `(params, batch) -> (loss, metrics dict)`.
    params: initial parameters (ignored when a checkpoint is resumed, but their
      structure is the template the checkpoint is read into).
    tc: steps and optimiser settings.
    batch_fn: `i -> batch` for step i.
    desc: progress-bar label.
    disable_bar: no tqdm bar.
    optimizer: default `make_optimizer(tc)`.
    checkpoint: resumable state: resume from its latest checkpoint if there is one, and
      write one every `every_s` seconds, at `stop_after` and at the end.
    stop_after: stop after this many steps in total (a checkpointed partial run; the
      caller resumes it later). None: run to `tc.steps`.
    flops_per_token: training FLOPs per token (e.g. 6 x parameters); the bar then shows
      tokens/s and GFLOP/s.
    log: where resume / checkpoint lines go.

  Returns:
    `(params, history)` with history a list of `(step, loss)` every ~2% of training.
  """
  opt = optimizer or make_optimizer(tc)
  step = _train_step(loss_fn, opt)
  opt_state = opt.init(params)
  history: list = []
  first = 0
  if checkpoint is not None:
    restored = _restore_training_state(checkpoint, params, opt_state)
    if restored is not None:
      first, params, opt_state, history = restored
      log(f"{desc}: resumed from {checkpoint.directory} after step {first} of {tc.steps}")
  last = tc.steps if stop_after is None else min(tc.steps, stop_after)
  every = max(1, tc.steps // 50)
  bar = tqdm(range(first, last), desc=desc, disable=disable_bar, mininterval=2.0,
             initial=first, total=tc.steps)
  saved_at = time.time()
  t_start, tokens = time.time(), 0
  for i in bar:
    batch = batch_fn(i)
    params, opt_state, loss, metrics = step(params, opt_state, batch)
    if i == first:  # the rate leaves out the first step, which compiles
      jax.block_until_ready(loss)
      t_start = time.time()
    else:
      tokens += int(np.prod(batch.shape[:2])) if hasattr(batch, "shape") else 0
    if i % every == 0 or i == tc.steps - 1:
      loss = float(loss)
      history.append((i, loss))
      rate = tokens / max(time.time() - t_start, 1e-9)
      post = {"loss": f"{loss:.3f}", **{k: f"{float(v):.3f}" for k, v in metrics.items()},
              "tok/s": f"{rate:.0f}"}
      if flops_per_token:
        post["GFLOP/s"] = f"{rate * flops_per_token / 1e9:.1f}"
      bar.set_postfix(post)
    done = i + 1
    if checkpoint is not None and (done == last or time.time() - saved_at >= checkpoint.every_s):
      _save_training_state(checkpoint, done, params, opt_state, history)
      saved_at = time.time()
  return params, history


def target_loss(params, tokens, *, cfg: ModelsConfig):
  loss = transformer.lm_loss(params, tokens, cfg=cfg.target)
  return loss, {}


def _soft_ce(teacher_log_probs, student_logits, mask=None):
  """Cross-entropy H(p_teacher, q_student), mean over unmasked rows."""
  ce = -jnp.sum(jnp.exp(teacher_log_probs) * jax.nn.log_softmax(student_logits), -1)
  if mask is None:
    return jnp.mean(ce)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)


def drafter_losses(dparams: dict, target_params, tokens, *, cfg: ModelsConfig):
  """Summed distillation losses of the drafters in `dparams` on `tokens [B, S+1]`.

  Teacher: the target on `tokens[:, :S]`: log-probs `p_t` of x_{t+1} and hidden `h_t`.
  * draft_lm: H(p_t, q_t) for every t.
  * eagle: input (h_{t-1}, x_t) at position t predicts p_t (t >= 1); `unroll` steps feed the
    head's own features back (step u uses step u-1's outputs), as at drafting depth u.
  * block: from (h_{t-1}, x_t) at anchors t, slot j predicts p_{t+j-1}, j = 1..K_max.
  """
  s = tokens.shape[1] - 1
  inp = tokens[:, :s]
  positions = jnp.broadcast_to(jnp.arange(s), inp.shape)
  teacher = transformer.forward(target_params, inp, positions, cfg=cfg.target)
  teacher_lp = jax.lax.stop_gradient(jax.nn.log_softmax(teacher.logits))  # [B, S, V]
  h = jax.lax.stop_gradient(teacher.hidden)                                  # [B, S, D]
  emb = jax.lax.stop_gradient(transformer.embedding(target_params))
  losses = {}
  if "draft_lm" in dparams:
    q = transformer.forward(dparams["draft_lm"], inp, positions, cfg=cfg.draft_lm).logits
    losses["draft_lm"] = _soft_ce(teacher_lp, q)
  if "eagle" in dparams:
    head = drafters_lib._eagle_module(cfg, "causal")  # pylint: disable=protected-access
    feats_in = h[:, :-1]
    total = 0.0
    for _ in range(cfg.eagle.unroll):
      f, q, _ = head.apply({"params": dparams["eagle"]}, emb, feats_in, inp[:, 1:],
                           positions[:, 1:])
      ce = _soft_ce(teacher_lp[:, 1:], q)
      reg = jnp.mean(optax.huber_loss(f, h[:, 1:], delta=1.0))
      total = total + ce + cfg.eagle.feature_loss * reg
      feats_in = jnp.concatenate([h[:, :1], f[:, :-1]], 1)
    losses["eagle"] = total / cfg.eagle.unroll
  if "block" in dparams:
    kmax = cfg.block.block_size
    anchors = jnp.arange(1, s, 4)                                  # [A]
    module = drafters_lib._block_module(cfg, "block")  # pylint: disable=protected-access
    _, q, _ = module.apply({"params": dparams["block"]}, emb, h[:, anchors - 1],
                           inp[:, anchors])                        # q [B, A, Kmax, V]
    idx = anchors[:, None] + jnp.arange(kmax)[None]                # [A, Kmax]
    mask = (idx <= s - 1).astype(jnp.float32)
    tlp = teacher_lp[:, jnp.minimum(idx, s - 1)]                   # [B, A, Kmax, V]
    losses["block"] = _soft_ce(tlp, q, jnp.broadcast_to(mask, q.shape[:-1]))
  return sum(losses.values()), losses


def fit_confidence_head(block_params, target_params, ctx_hidden, ctx_token, labels, mask, *,
                        cfg: ModelsConfig, steps: int, lr: float, batch: int, seed: int):
  """Fits `block_head`'s linear confidence head on verification labels.

  Args:
    block_params: trained `block` drafter parameters (frozen).
    target_params: target parameters (for the shared embedding).
    ctx_hidden: `[N, D]` target hidden state that was the drafter's input per draft step.
    ctx_token: `[N]` newest committed token per draft step.
    labels: `[N, K]` bool accept (True) / reject labels.
    mask: `[N, K]` bool, position has a label.
    cfg: model set config.
    steps, lr, batch, seed: optimisation settings (Adam, full-batch-free minibatches).

  Returns:
    `block_head` parameters (the block parameters plus `conf_head`).
  """
  module = drafters_lib._block_module(cfg, "block_head")  # pylint: disable=protected-access
  k = labels.shape[1]
  emb = transformer.embedding(target_params)
  feats_fn = jax.jit(lambda hid, tok: drafters_lib._block_module(cfg, "block").apply(  # pylint: disable=protected-access
      {"params": block_params}, emb, hid, tok)[0][:, :k])
  feats = np.concatenate([np.asarray(feats_fn(ctx_hidden[i:i + 256], ctx_token[i:i + 256]))
                          for i in range(0, len(ctx_token), 256)])  # [N, K, D]
  rows = np.nonzero(mask)
  x = feats[rows]                                                # [L, D]
  y = labels[rows].astype(np.float32)
  init = module.init(jax.random.key(seed), emb, jnp.zeros([1, cfg.target.d_model]),
                     jnp.zeros([1], jnp.int32))["params"]["conf_head"]
  # Start from the log-odds of the base rate: a calibrated constant predictor.
  base = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
  init = {"kernel": init["kernel"], "bias": jnp.full_like(init["bias"], np.log(base / (1 - base)))}

  def loss_fn(head, xb, yb):
    z = (xb @ head["kernel"])[:, 0] + head["bias"][0]
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z, yb))

  opt = optax.adam(lr)

  @jax.jit
  def step(head, state, xb, yb):
    loss, g = jax.value_and_grad(loss_fn)(head, xb, yb)
    upd, state = opt.update(g, state, head)
    return optax.apply_updates(head, upd), state, loss

  rng = np.random.default_rng(seed)
  head, state = init, opt.init(init)
  for _ in range(steps):
    i = rng.integers(0, len(y), size=min(batch, len(y)))
    head, state, _ = step(head, state, jnp.asarray(x[i]), jnp.asarray(y[i]))
  return {**block_params, "conf_head": head}
