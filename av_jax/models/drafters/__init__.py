"""The four drafter kinds behind one interface.

| kind         | drafting       | what it is                                                        |
|--------------|----------------|-------------------------------------------------------------------|
| `draft_lm`   | autoregressive | independent small LM with its own KV cache                        |
| `eagle`      | autoregressive | one transformer layer over (target hidden, next-token embedding), |
|              |                | shares the target's embedding/head, feeds its own features back   |
| `block`      | parallel       | K positions in one pass from the target's last hidden state       |
| `block_head` | parallel       | `block` plus a linear confidence head trained on target accepts   |

`drafting` matters to AV's exactness (docs/algorithm.md section 5, rule 2): with an
autoregressive drafter and sampled drafts, q at position i+1 depends on the token drawn at
position i.

The `Drafter` protocol: what the engine calls on a drafter, av_jax's four kinds and a
drafter of the user's own alike (`make_engine(config, target=..., drafter=...)`;
`examples/own_model_engine.py`, `tests/test_drafter_protocol.py`). All functions are pure
and jit-traceable; `K` is static, `temperature` / `top_p` may be traced arrays.

What the drafter's author writes (`Drafter` fields):

  state = drafter.init_state(params, target_params, prompt=[B,P], prompt_hidden=[B,P,D],
                             next_token=[B], K=K, max_len=M, prompt_lens=[B] or None)
  out = drafter.draft(params, target_params, state, key, K=K, temperature=t, top_p=p)
  # out.logits [B,K,V], out.tokens [B,K], out.conf_logits [B,K] or None, out.state
  out = drafter.draft(..., keep_fn=keep_fn, keep_init=aux)   # drafters with `stepwise`
  # keep_fn(depth, logits [B,V], log_probs [B,V], aux) -> (keep [B] bool, aux), called
  # after each depth; depth j+1 is drafted for the rows that keep (stopping is
  # absorbing) and the loop ends when none does: out.depth [B], out.passes []
  state = drafter.commit(out.state, emitted_tokens=[B,K+1], num_emitted=[B],
                         target_hidden=[B,K+1,D])
  # optional: skips=True (rows may skip drafting), and how they catch up:
  state = drafter.catch_up(params, target_params, state, token=[B], hidden=[B,D],
                           mask=[B])                          # a state of its own layout
  state = drafter.absorb(params, target_params, state)       # a DrafterState: see below

B is whatever number of rows the state holds: the engine's B slots, the E rows of a draft
bucket, or the one row of a prefill.

What the engine calls (`Drafter` methods, built on the fields; the engine calls nothing
else, and never looks inside a state):

  state = drafter.start(params, target_params, width=W, **init_state inputs)
  state = drafter.insert_row(state, one_row, slot)           # a prefill's row into slot
  state = drafter.keep_rows(new, old, mask [B])              # new where mask, else old
  rows = drafter.take_rows(state, idx [E]); state = drafter.put_rows(state, rows, idx, keep [E])
  out, update = drafter.draft_rows(params, target_params, state, key, rows=[E] or None,
                                   keep=[E], K=K, temperature=t, top_p=p)  # (+ keep_fn)
  update = drafter.settle_rows(params, target_params, state, rows=..., keep=..., K=K)
  update = drafter.unchanged(state, K=K)                     # a step drafting no row
  state = drafter.write_back(state, update, K=K)             # after the engine's switch
  full = drafter.full_rows(state, K=K)                       # [B] bool, or None
  state = drafter.commit_rows(state, emitted_tokens=..., num_emitted=..., target_hidden=...)
  state = drafter.catch_up_rows(params, target_params, state, token=[B], hidden=[B,D],
                                mask=[B], K=K)

A step that drafts every row calls `draft` and `commit_rows` on the whole state. A step
under subset drafting (the `av` arm, a drafter with `skips`) gathers the rows that draft
into a draft bucket of E rows and calls `draft_rows` in one `lax.switch` branch per E:
the bucket's rows are taken, settle any backlog and draft; the branch returns their
drafts and an `update` of one shape for every E, which `write_back` writes after the
switch (so a large cache is written in place, not copied by the switch); then the rows
that drafted `commit_rows` and the others `catch_up_rows` on the token the target emitted
for them. Where the rows live in a state is declared, not inferred by the engine:
`slot_axis` (an int, or a hashable pytree prefix of the state such as a NamedTuple of
ints), or None for a `DrafterState`.

What the arguments are:

- `params`: `Params.drafter`, any pytree; `target_params`: `Params.target`, any pytree (av_jax's
  EAGLE and block drafters read the target's tied embedding from it; others ignore it).
- `prompt_hidden [B, P, D]` and `target_hidden [B, K+1, D]`: the `hidden` the target
  returns for those tokens (`av_jax.engine.protocols.Target`; D = `Target.hidden_size`).
  For av_jax's transformer it is the final hidden state after the final norm; for a user's
  target it is whatever its `verify` / `prefill` return as `hidden`. The engine never reads
  it.
- The state is a `DrafterState` (`slot_axis` None, the default) or any pytree of the
  author's own whose leaves hold the rows at `slot_axis`. A `DrafterState`'s `cache` is
  the drafter's own: None, a `KVCache` (slots on axis 1), or any array with slots on axis
  0 (e.g. a token history `[B, M]`); `commit` below is shared by every kind and fits any.
- `draft` returns a `DraftOutput`; `log_probs` (what the tokens were drawn from, with
  temperature and top-p) is optional but saves a second top-p pass. With temperature <= 0
  the tokens must be the arg-max of `logits`.
- `Drafter.kind` names the drafter (profile and checkpoint caches key on it; only
  "block_head" enables the `av_head` arm); `Drafter.drafting` is "autoregressive" or
  "parallel" and decides the exact budget policy.
- `skips` (default False) lets a step leave rows out of drafting. Their state must stay as
  if they had drafted: a state of the author's layout needs `catch_up`; a `DrafterState`
  catches up by `catch_up` below, which needs a parallel drafter (one that keeps no cache
  a skipped step would leave behind) or `absorb`, and without either its rows all draft
  (`Drafter.skips_rows`). av_jax's four kinds declare it.
- `absorb(params, target_params, state) -> state` (optional, a `DrafterState`'s): writes
  the pending block into the drafter's own cache without drafting, as the first forward
  of `draft` does (draft_lm: the LM over the pending tokens; eagle: the head over the
  (hidden, token) pairs). Only the returned `cache` is used; `catch_up` then starts a new
  pending block. With `skips` it gives the rows that skip a backlog (`Drafter.backlog`,
  "Lazy catch-up" below), so `absorb` must take a pending block of any width P >= K+1 and
  write only the first `num_pending` entries of each slot (none where it is 0).

Sequence bookkeeping. The committed sequence of slot b ends with token x_n at position n
(the last emitted token, not yet seen by the target). The state holds the committed tokens
the drafter has not consumed yet ("pending", at most K+1, the last of which is x_n), each
paired with the target hidden state that predicted it. `draft` consumes the pending block
and drafts x_{n+1..n+K}. The verification pass runs the target on [x_n, d_1..d_K] at
positions n..n+K; its hidden states and the emitted tokens become the next pending block
(`commit`). Drafter cache entries above the consumed prefix are stale but never read.

Catch-up (`catch_up`). On a step where a slot does not draft, the target emits one token
for it; the drafter's state must stay as if drafting had never stopped (a stale drafter
state collapses acceptance: skipped drafting did so in TensorRT-LLM). The
committed token and the target hidden state that predicted it are appended to the pending
block; when the block is full (K+1 entries) `absorb` consumes it into the cache first and
the token starts a new block. The next `draft` consumes the whole block, so it sees what
it would have seen had it drafted at every step (tested: tests/test_drafter_catchup.py).
Parallel drafters keep no cache: their pending block becomes the one new token.

Lazy catch-up (a backlog). A state `widen`ed to P > K+1 pending columns lets a slot that
does not draft keep up to P committed tokens (with their target hidden states) pending:
`catch_up` then absorbs only when P are pending, and a slot that drafts again first
absorbs its backlog (`settle`, all but the newest entry, which stays pending), so the
absorb runs for the slots that draft, on the step they draft, and never for the tokens
of a request that ends while it does not draft. `draft` and `commit` see K+1 columns
(`settle`'s result; `narrow`); the engine keeps P (`Programs.drafter_backlog`;
`Drafter.start` widens, `Drafter.commit_rows` narrows and widens back). With a `KVCache`
cache a draft bucket's `update` holds only the entries its rows wrote (`CacheWindow`,
P + 1 positions per row from `window_start`) and its rows' pending counts, and
`full_rows` names the rows whose backlog is full: the engine gathers them into the step's
draft bucket to absorb (`draft_rows` with `keep`, or `settle_rows` on a step that drafts
for no row), so `catch_up_rows` never absorbs.

The package's modules: `protocol` (`Drafter`, `DraftOutput`, `KINDS`, `DRAFTING`),
`state` (`DrafterState`, its rows, pending width and cache windows, `commit`), `backlog`
(`catch_up`, `settle`, the in-place row updates behind `Drafter`'s row verbs), `kinds`
(av_jax's four kinds: their flax modules, `init_drafter_params`, `make_drafter`).
"""

from av_jax.models.drafters.backlog import can_skip, catch_up, settle
from av_jax.models.drafters.kinds import (BlockDrafter, EagleHead, _block_module, _eagle_module,
                                          init_drafter_params, make_drafter)
from av_jax.models.drafters.protocol import DRAFTING, KINDS, DraftOutput, Drafter
from av_jax.models.drafters.state import (CacheWindow, DrafterState, commit, insert_slot,
                                          keep_inactive, narrow, put_slots, read_window,
                                          take_slots, widen, window_shape, window_start,
                                          write_window)

__all__ = (
    "DRAFTING",
    "KINDS",
    "BlockDrafter",
    "CacheWindow",
    "DraftOutput",
    "Drafter",
    "DrafterState",
    "EagleHead",
    "can_skip",
    "catch_up",
    "commit",
    "init_drafter_params",
    "insert_slot",
    "keep_inactive",
    "make_drafter",
    "narrow",
    "put_slots",
    "read_window",
    "settle",
    "take_slots",
    "widen",
    "window_shape",
    "window_start",
    "write_window",
    # the modules' builders, which av_jax.models.train and the tests use
    "_block_module",
    "_eagle_module",
)
