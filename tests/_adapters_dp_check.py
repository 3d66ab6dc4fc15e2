"""Run in a fresh process with 2 fake CPU devices (see test_adapters_dp.py).

Two data-parallel replicas serve different requests through the adapters' learning path
(sampler -> labels recovered from the stack's output -> `update(axis_name="data")`), each
with its own `learn` mask, and print a JSON verdict: whether the replicas' coefficients
were bit-identical after every step, whether they equal one estimator fed both replicas'
labels as one batch, and (the negative control) whether replicas that do not sum their
statistics over the mesh axis agree.
"""

import json

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from av_jax.estimator import online_estimator  # noqa: E402
from av_jax.integrations import tpu_inference as tpu  # noqa: E402
from av_jax.integrations import vllm  # noqa: E402

B, K, V, STEPS, REFIT = 8, 3, 10, 12, 3
GREEDY = type("Greedy", (), {"do_sampling": False, "logprobs": False})()


def replica_step(est, state_v, state_t, state_n, key, q, x, logits, n, features, learn):
  """One replica's step through both adapters (its own `[B, ...]` requests)."""
  key, q, x, logits, n, features, learn = (a[0] for a in (key, q, x, logits, n, features, learn))
  ids, counts, flat_q = vllm.pack_drafts(x, n, draft_probs=q)
  T = B * K
  # vLLM: target rows interleaved with bonus rows, labels from `sampled_token_ids`.
  i = jnp.arange(K + 1)
  starts = jnp.cumsum(counts) - counts
  rows = jnp.where(i[None, :] <= counts[:, None], starts[:, None] + jnp.arange(B)[:, None]
                   + i[None, :], T + B)
  probs = jax.nn.softmax(logits, axis=-1)
  target = jnp.zeros((T + B, V)).at[rows.reshape(-1)].set(probs.reshape(-1, V), mode="drop")
  out = vllm.rejection_sample(key, draft_token_ids=ids, num_draft_tokens=counts,
                              max_spec_len=K, draft_probs=flat_q, target_probs=target)
  acc_v, lab_v, _ = vllm.labels_from_output(out.sampled_token_ids, counts, learn=learn)
  # tpu-inference: T target rows (greedy), labels from `[T main | B bonus]`.
  t_logits = jnp.zeros((T, V)).at[jnp.where(i[None, :K] < counts[:, None], starts[:, None]
                                            + i[None, :K], T).reshape(-1)].set(
      logits[:, :K].reshape(-1, V), mode="drop")
  output = tpu.RejectionSampler(None, max_draft_len=K)(
      ids, counts, None, t_logits, jnp.zeros((B,), jnp.int32), GREEDY)
  acc_t, lab_t, _ = tpu.labels_from_output(output, counts, max_draft_len=K, learn=learn)
  state_v = est.update(state_v, features, acc_v, lab_v, axis_name="data")
  state_t = est.update(state_t, features, acc_t, lab_t, axis_name="data")
  # The negative control: the same labels without summing over the mesh axis.
  state_n = est.update(state_n, features, acc_v, lab_v)
  labels = (acc_v, lab_v, acc_t, lab_t)
  stack = lambda tree: jax.tree.map(lambda a: a[None], tree)
  return stack(state_v), stack(state_t), stack(state_n), tuple(a[None] for a in labels)


def main() -> None:
  assert len(jax.devices()) == 2, jax.devices()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  est = online_estimator(K, refit_interval=REFIT, init_intercept=0.0)
  data, rep = P("data"), P()
  step = jax.jit(jax.shard_map(
      lambda sv, st, sn, *xs: replica_step(est, sv, st, sn, *xs), mesh=mesh,
      in_specs=(rep, rep, data) + (data,) * 7, out_specs=(data,) * 4))
  reference = jax.jit(est.update)
  state_v = state_t = est.init()
  state_n = jax.tree.map(lambda a: jnp.stack([a, a]), est.init())  # one per replica
  ref_v = ref_t = est.init()
  identical, matches, refits, differ, control = [], [], [], [], []
  key = jax.random.key(0)
  for s in range(STEPS):
    key, *ks = jax.random.split(key, 8)
    base = 2.0 * jax.random.normal(ks[0], (2, B, K + 1, V))
    logits = base + jax.random.normal(ks[1], (2, B, K + 1, V))
    q = jax.nn.softmax(base[:, :, :K], axis=-1)
    x = jax.random.categorical(ks[2], jnp.log(q)).astype(jnp.int32)
    n = jax.random.randint(ks[3], (2, B), 0, K + 1)
    features = jax.random.normal(ks[4], (2, B, K))
    learn = jax.random.uniform(ks[5], (2, B)) < 0.75
    keys = jax.random.split(ks[6], 2)
    sv, st, state_n, labels = step(state_v, state_t, state_n, keys, q, x, logits, n,
                                   features, learn)
    # Both replicas' copies, bit for bit.
    same = all(bool(np.array_equal(np.asarray(a)[0], np.asarray(a)[1]))
               for a in jax.tree.leaves((sv, st)))
    identical.append(same)
    control.append(bool(np.array_equal(np.asarray(state_n.intercepts)[0],
                                       np.asarray(state_n.intercepts)[1])))
    state_v = jax.tree.map(lambda a: a[0], sv)
    state_t = jax.tree.map(lambda a: a[0], st)
    # One estimator fed both replicas' (masked) labels as one batch of 2B requests.
    acc_v, lab_v, acc_t, lab_t = (np.asarray(a).reshape(2 * B, K) for a in labels)
    f = np.asarray(features).reshape(2 * B, K)
    ref_v = reference(ref_v, f, acc_v, lab_v)
    ref_t = reference(ref_t, f, acc_t, lab_t)
    close = lambda a, b: bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5))
    matches.append(all(close(getattr(a, name), getattr(b, name))
                       for a, b in ((state_v, ref_v), (state_t, ref_t))
                       for name in ("slope", "intercepts")))
    refits.append(int(state_v.num_refits))
    # The replicas saw different requests: their own labels differ.
    differ.append(bool(np.any(np.asarray(labels[1])[0] != np.asarray(labels[1])[1])))
  print("RESULT " + json.dumps(dict(identical=identical, matches=matches, refits=refits,
                                    differ=differ, control_identical=control,
                                    moved=float(abs(state_v.slope - est.init().slope)))))


if __name__ == "__main__":
  main()
