"""Training survives a stop (stopped + resumed == uninterrupted), and the measurements of MODELS.md."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import data
from av_jax import models
from av_jax.data.tokenizer import train_tokenizer
from av_jax.models import drafters, evaluate, pipeline, train, transformer

CFG = models.load_config("tiny")


def _batches(tc, seed=3):
  rng_of = lambda i: np.random.default_rng([seed, i])
  V = CFG.target.vocab_size
  return lambda i: jnp.asarray(rng_of(i).integers(0, V, size=(tc.batch, tc.seq_len + 1)),
                               jnp.int32)


def _fit(tc, params, loss, tmp=None, stop_after=None, optimizer=None):
  ckpt = None if tmp is None else train.TrainingCheckpoint(str(tmp), every_s=1e9)
  return train.fit(loss, params, tc, _batches(tc), desc="t", disable_bar=True,
                   checkpoint=ckpt, stop_after=stop_after, optimizer=optimizer,
                   log=lambda _: None)


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_target_stopped_and_resumed_equals_uninterrupted(tmp_path):
  tc = dataclasses.replace(CFG.train_target, steps=6, warmup=2)
  params = transformer.init_params(CFG.target, jax.random.key(0))
  loss = lambda p, b: train.target_loss(p, b, cfg=CFG)
  opt = train.make_optimizer(tc)
  full, hist_full = _fit(tc, params, loss, optimizer=opt)
  part, _ = _fit(tc, params, loss, tmp_path, stop_after=3, optimizer=opt)
  # The partial run really stopped early: its parameters differ from the full run's.
  assert not np.allclose(np.asarray(jax.tree.leaves(part)[0]),
                         np.asarray(jax.tree.leaves(full)[0]))
  # A fresh call (new process in real use) starts from other parameters and resumes.
  other = transformer.init_params(CFG.target, jax.random.key(9))
  resumed, hist = _fit(tc, other, loss, tmp_path, optimizer=opt)
  _close(resumed, full)
  assert [s for s, _ in hist] == [s for s, _ in hist_full]
  # Finished: resuming again runs no step and returns the same parameters.
  again, _ = _fit(tc, other, loss, tmp_path, optimizer=opt)
  _close(again, full)


def test_drafters_per_model_optimizer_resumes(tmp_path):
  tc = dataclasses.replace(CFG.train_drafters, steps=4, warmup=1)
  target = transformer.init_params(CFG.target, jax.random.key(0))
  dparams = {k: drafters.init_drafter_params(k, CFG, jax.random.key(i))
             for i, k in enumerate(("block",))}
  loss = lambda p, b: train.drafter_losses(p, target, b, cfg=CFG)
  opt = train.make_per_model_optimizer(tc)
  full, _ = _fit(tc, dparams, loss, optimizer=opt)
  _fit(tc, dparams, loss, tmp_path, stop_after=2, optimizer=opt)
  resumed, _ = _fit(tc, dparams, loss, tmp_path, optimizer=opt)
  _close(resumed, full)


def test_existing_run_is_not_overwritten_without_resume(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="resume"):
    pipeline.train_all(CFG, str(tmp_path / "out"), progress=False, work_dir=str(tmp_path))


def test_resume_refuses_another_config(tmp_path):
  (tmp_path / "config.json").write_text('{"name": "other"}')
  with pytest.raises(ValueError, match="another config"):
    pipeline.train_all(CFG, str(tmp_path / "out"), progress=False, work_dir=str(tmp_path),
                       resume=True)


def test_bits_per_byte_matches_loss_and_byte_count():
  texts = [d.text for d in data.documents("prose", "train", config=CFG.data)]
  tok = train_tokenizer(texts, vocab_size=CFG.target.vocab_size)
  stream = data.token_stream("prose", "train", tokenizer=tok, config=CFG.data)
  windows = data.sample_windows(stream, np.random.default_rng(0), num=16, length=17)
  params = transformer.init_params(CFG.target, jax.random.key(0))
  loss = evaluate.heldout_loss(params, windows, cfg=CFG.target, batch=16)
  lengths = tok.byte_lengths()
  bpb = evaluate.heldout_bits_per_byte(params, windows, lengths, cfg=CFG.target)
  num_bytes = sum(len(tok.decode_bytes([int(t)])) for t in windows[:, 1:].ravel())
  np.testing.assert_allclose(bpb, loss * windows[:, 1:].size / np.log(2) / num_bytes,
                             rtol=1e-6)
  assert lengths[0] == 0 and lengths.min() == 0 and lengths[1:].min() >= 1


def test_sample_continuations_greedy_equals_uncached_argmax():
  params = transformer.init_params(CFG.target, jax.random.key(0))
  prompts = jax.random.randint(jax.random.key(1), (2, 5), 0, CFG.target.vocab_size)
  got = evaluate.sample_continuations(params, prompts, jax.random.key(2), cfg=CFG.target,
                                      steps=6, temperature=0.0, top_p=1.0)
  seq = prompts
  for _ in range(6):
    pos = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
    logits = transformer.forward(params, seq, pos, cfg=CFG.target).logits[:, -1]
    seq = jnp.concatenate([seq, jnp.argmax(logits, -1)[:, None].astype(seq.dtype)], 1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(seq[:, 5:]))
