"""Sharding the engine over a ('data', 'model') device mesh with `jax.jit` shardings.

Layout (the successor of pjit: `jax.jit` with `in_shardings` / `out_shardings`):

* slots (B) over 'data': the sequence buffer, per-slot lengths and flags, every KV cache
  (`[L, B, H, M, Dh]` -> `P(None, 'data', 'model', None, None)`), the drafter's pending
  block;
* attention heads and MLP width over 'model': q/k/v kernels `[D, H, Dh]` split on H, the
  output kernel `[H, Dh, D]` on H, gate/up `[D, F]` on F, down `[F, D]` on F;
* replicated: embeddings, norms, the estimator and planner states, the cost tables, the
  PRNG key and the running statistics.

The estimator's round statistics are sums over all slots. Under `jax.jit` the compiler
inserts the cross-'data' reduction itself, so every replica holds bit-identical
coefficients after each refit (replicas that disagreed on the budget would deadlock a
real deployment). Inside `jax.shard_map` code, pass `axis_name='data'` to `est.update`.

Verification is data-parallel when the engine's verify groups line up with the 'data'
shards: `verify._verify_packed` packs each of G = `Programs.verify_groups` contiguous
slot groups into its own buffer, so with G a multiple of the 'data' size every group's
packed forward reads only its own shard's caches. `for_mesh` sets G to the 'data' size
when the config leaves it None (`generate(mesh=...)` does this). With a single group on a
multi-shard mesh, every shard would run the dense layers on all packed tokens and gather
each token's cache row across 'data' (2 L T M H Dh numbers per step; docs/scaling.md).

The mesh may span several processes (JAX's multi-controller runtime,
`av_jax.engine.distributed`): `place` then builds each global array from the host value
every process holds, each process writing only its own devices' shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from av_jax.engine import core
from av_jax.models.drafters import DrafterState

DATA, MODEL = "data", "model"


def make_mesh(data: int, model: int, *, explicit: bool = False,
              devices=None) -> Mesh:
  """A `(data, model)` mesh; `explicit=True` uses Explicit axis types (sharding in types)."""
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  if devices is None:
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(kind, kind))
  return Mesh(devices, (DATA, MODEL), axis_types=(kind, kind))


def is_explicit(mesh: Mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def _leaf_name(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_spec(path, leaf) -> P:
  """Partition spec of one parameter, from its name path (Megatron-style split). A
  transformer's scanned layers (`layers/...`) carry a leading layer axis, replicated:
  `layers/attn/q/kernel [L, D, H, Dh]` splits H like a single layer's `[D, H, Dh]`."""
  names = _leaf_name(path)
  if names[-1] != "kernel":
    return P()
  lead = (None,) if "layers" in names[:-1] else ()
  ndim = leaf.ndim - len(lead)
  owner = names[-2] if len(names) >= 2 else ""
  if owner in ("q", "k", "v") and ndim == 3:
    return P(*lead, None, MODEL, None)
  if owner == "o" and ndim == 3:
    return P(*lead, MODEL, None, None)
  if owner in ("gate", "up") and ndim == 2:
    return P(*lead, None, MODEL)
  if owner == "down" and ndim == 2:
    return P(*lead, MODEL, None)
  return P()


def param_shardings(mesh: Mesh, params: Any) -> Any:
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, param_spec(path, leaf)), params)


def _cache_sharding(mesh, cache):
  """Every leaf of av_jax's KV cache `[L, B, H, M, Dh]`: slots over 'data', heads over
  'model' (None: None)."""
  spec = NamedSharding(mesh, P(None, DATA, MODEL, None, None))
  return jax.tree.map(lambda _: spec, cache)


def state_shardings(mesh: Mesh, state: core.DecodeState) -> core.DecodeState:
  """Shardings of every field of a decode state (see the module docstring)."""
  slots = NamedSharding(mesh, P(DATA))
  replicated = NamedSharding(mesh, P())
  rep = lambda tree: jax.tree.map(lambda _: replicated, tree)
  drafter = state.drafter
  return core.DecodeState(
      target_cache=_cache_sharding(mesh, state.target_cache),
      drafter=DrafterState(cache=_cache_sharding(mesh, drafter.cache), tokens=slots,
                           hidden=slots, num_pending=slots, position=slots),
      tokens=slots, length=slots, prompt_len=slots, max_new=slots, active=slots,
      estimator=rep(state.estimator), planner=rep(state.planner), cost=rep(state.cost),
      key=replicated, stats=rep(state.stats))


def check_divisible(engine: core.Engine, mesh: Mesh) -> None:
  """Raises a ValueError naming what does not divide over the mesh."""
  data, model = mesh.shape[DATA], mesh.shape[MODEL]
  if engine.config.num_slots % data:
    raise ValueError(f"num_slots: {engine.config.num_slots} is not divisible by the "
                     f"'data' axis of size {data}")
  t = engine.models.target
  for name, value in (("num_heads", t.num_heads), ("mlp_dim", t.mlp_dim)):
    if value % model:
      raise ValueError(f"target {name}: {value} is not divisible by the 'model' axis of "
                       f"size {model}")


def for_mesh(engine: core.Engine, mesh: Mesh) -> core.Engine:
  """The engine to run on `mesh`: verify groups set to the 'data' size when left None.

  Args:
    engine: the engine; an explicit `programs.verify_groups` is kept as it is.
    mesh: the ('data', 'model') mesh.

  Returns:
    `engine`, or a copy whose config has `programs.verify_groups` = the 'data' axis size, so each
    data shard packs and verifies only its own slots (see the module docstring).

  Raises:
    ValueError: num_slots is not divisible by the 'data' axis size.
  """
  check_divisible(engine, mesh)
  if engine.config.programs.verify_groups is not None:
    return engine
  programs = dataclasses.replace(engine.config.programs, verify_groups=int(mesh.shape[DATA]))
  config = dataclasses.replace(engine.config, programs=programs)
  return engine._replace(config=config)


def _put_global(x: Any, target: NamedSharding) -> jax.Array:
  """One leaf as a global array with sharding `target` on a mesh spanning processes.

  `jax.device_put` refuses host-local jax arrays and typed PRNG keys for non-addressable
  shardings and checks other inputs with one cross-process gather per leaf; here every
  process already holds the same value, so each writes its addressable shards from it.
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return x if x.sharding == target else jax.device_put(x, target)
  if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
    data = _put_global(jax.random.key_data(x), target)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def put(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` that also works when the mesh spans processes.

  Args:
    tree: a pytree of arrays, the same values in every process.
    shardings: a matching pytree of `NamedSharding` (None subtrees allowed).

  Returns:
    The tree as (global) arrays with those shardings.
  """
  leaves = jax.tree.leaves(shardings)
  if all(s.is_fully_addressable for s in leaves):
    return jax.device_put(tree, shardings)
  return jax.tree.map(_put_global, tree, shardings)


def place(engine: core.Engine, mesh: Mesh, params: core.Params,
          state: core.DecodeState) -> tuple[core.Params, core.DecodeState]:
  """Puts parameters and a decode state on the mesh with their shardings.

  Works for a mesh within one process and for a global mesh spanning processes (every
  process then passes the same `params` and `state`).
  """
  check_divisible(engine, mesh)
  params = put(params, param_shardings(mesh, params))
  state = put(state, state_shardings(mesh, state))
  return params, state


def init_state(engine: core.Engine, mesh: Mesh, params: core.Params, key: jax.Array,
               cost=None) -> core.DecodeState:
  """A fresh decode state created directly with its shardings (`core.init_state`).

  Each device allocates only its own shard of the caches and sequence buffer, so a state
  larger than one device (or one host) never exists in one place.

  Args:
    engine: the engine.
    mesh: the ('data', 'model') mesh, within one process or spanning several.
    params: parameters already placed on `mesh` (`place` / `put`).
    key: PRNG key of the run (the same in every process).
    cost: step-cost tables; `core.default_cost` when None.

  Returns:
    The state, sharded as `state_shardings` says.
  """
  check_divisible(engine, mesh)
  cost = core.default_cost(engine.config) if cost is None else cost
  fn = lambda params, key, cost: core.init_state(engine, params, key, cost)
  state_sh = state_shardings(mesh, jax.eval_shape(fn, params, key, cost))
  replicated = NamedSharding(mesh, P())
  rep = lambda tree: jax.tree.map(lambda _: replicated, tree)
  if is_explicit(mesh):
    fn = jax.sharding.auto_axes(fn, out_sharding=jax.tree.map(lambda sh: sh.spec, state_sh))
  init = jax.jit(fn, in_shardings=(param_shardings(mesh, params), replicated, rep(cost)),
                 out_shardings=state_sh)
  return init(params, put(key, replicated), put(cost, rep(cost)))
