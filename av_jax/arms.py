"""The arms a decode run can take, in one registry: what each drafts, scores and plans.

An arm is a way of choosing what to verify; the engine (`EngineConfig.mode`), the
synthetic simulator and the studies name arms from here and nowhere else.

| arm           | drafts | acceptance from       | budget policy                  | counts as verified |
|---------------|--------|-----------------------|--------------------------------|--------------------|
| `target_only` | no     | -                     | `none`                         | nothing            |
| `fixed`       | yes    | -                     | `fixed` (all K of every slot)  | what it verified   |
| `av`          | yes    | the online estimator  | `av_jax.policy`: one priced choice | what it verified |
| `av_head`     | yes    | the confidence head   | exact for the drafter          | what it verified   |
| `confstop`    | yes    | -                     | `fixed`, confidence stop       | what it verified   |
| `oracle`      | yes    | -                     | `fixed`, hindsight accounting  | only the accepted  |

`av` decides who drafts, how deep and what is verified from one objective
(`av_jax.policy`, through `av_jax.decider`): a request stops drafting at the depth its
plan chose (`Arm.stop == "policy"`). `av_head` verifies by the budget rule
(`av_jax.planner`) on the drafter's confidence-head probabilities, drafting all K.
`confstop:T` is vLLM's `DraftConfidenceStop`: the batch drafts depth j+1 while some
request's drafts so far all have top-1 probability >= T, and every request verifies the
same count (no budget).

`parse_arm("fixed:4")` reads an arm name with an optional draft length, the form a
command line or a comparison lists arms in; `parse_arm("confstop:0.8")` reads the
confidence threshold T instead (`confstop` alone is T = 0.5).
"""

from __future__ import annotations

from typing import NamedTuple

from av_jax.planner import exact_policy, is_exact


class Arm(NamedTuple):
  """One arm (hashable, static)."""
  name: str            # key in ARMS
  drafts: bool         # the arm drafts (False: plain target-only decoding)
  adaptive: bool       # AV: the planner chooses the budget under an exact policy
  head: bool           # acceptance probabilities from the drafter's confidence head
  hindsight: bool      # counts only the accepted drafts as verified (a ceiling, not lossless)
  policy: str | None   # the fixed budget policy of a non-adaptive arm; None when adaptive
  stop: str = "none"   # drafting stop for autoregressive drafters: "none" (all K),
                       # "policy" (the plan's depth) or "confidence" (`confstop:T`)
  threshold: float | None = None  # T of the "confidence" stop; None for the others


ARMS: dict[str, Arm] = {
    "target_only": Arm("target_only", drafts=False, adaptive=False, head=False,
                       hindsight=False, policy="none"),
    "fixed": Arm("fixed", drafts=True, adaptive=False, head=False, hindsight=False,
                 policy="fixed"),
    "av": Arm("av", drafts=True, adaptive=True, head=False, hindsight=False, policy=None,
              stop="policy"),
    "av_head": Arm("av_head", drafts=True, adaptive=True, head=True, hindsight=False,
                   policy=None),
    "confstop": Arm("confstop", drafts=True, adaptive=False, head=False, hindsight=False,
                    policy="fixed", stop="confidence", threshold=0.5),
    "oracle": Arm("oracle", drafts=True, adaptive=False, head=False, hindsight=True,
                  policy="fixed"),
}


def get_arm(name: str) -> Arm:
  """The arm called `name` (one of `ARMS`, or `confstop:T` with a threshold T).

  Raises:
    ValueError: naming the argument and the known arms.
  """
  base, sep, value = name.partition(":")
  if sep and base == "confstop":
    return ARMS[base]._replace(threshold=_threshold(value, name))
  if name not in ARMS:
    raise ValueError(f"arm: expected one of {tuple(ARMS)} (or confstop:T), got {name!r}")
  return ARMS[name]


def _threshold(value: str, text: str) -> float:
  try:
    t = float(value)
  except ValueError:
    t = float("nan")
  if not 0.0 <= t <= 1.0:  # also refuses NaN
    raise ValueError(f"arm: expected confstop:T with a threshold T in [0, 1], got {text!r}")
  return t


def parse_arm(text: str) -> tuple[Arm, int | None]:
  """`"av"` -> (ARMS["av"], None); `"fixed:4"` -> (ARMS["fixed"], 4): an arm and an
  optional maximum draft length K. `"confstop:0.8"` -> (the `confstop` arm with
  threshold 0.8, None): for `confstop` the suffix is the threshold T.

  Raises:
    ValueError: an unknown arm, a draft length that is not a positive integer, or a
      confstop threshold outside [0, 1].
  """
  name, sep, length = text.partition(":")
  if name == "confstop":
    return get_arm(text), None
  arm = get_arm(name)
  if not sep:
    return arm, None
  if not arm.drafts or not length.isdigit() or int(length) < 1:
    raise ValueError(f"arm: expected NAME or NAME:K with K >= 1 for a drafting arm, got "
                     f"{text!r}")
  return arm, int(length)


def policy_for(arm: Arm, *, drafting: str, greedy: bool, requested: str | None = None) -> str:
  """The budget policy `arm` plans with for a drafting style and temperature.

  Args:
    arm: the arm.
    drafting: the drafter's style, "autoregressive" or "parallel".
    greedy: whether drafts are drawn greedily (temperature 0).
    requested: a policy asked for explicitly (used by adaptive arms, checked for all);
      None picks the exact one.

  Raises:
    ValueError: a requested policy that is not exact for this drafter.
  """
  exact = exact_policy(drafter_kind=drafting, greedy=greedy)
  policy = requested or exact
  if not is_exact(policy, drafter_kind=drafting, greedy=greedy):
    raise ValueError(f"policy: {policy!r} is not lossless for a {drafting} drafter with "
                     f"{'greedy' if greedy else 'sampled'} drafts; use {exact!r}")
  return policy if arm.adaptive else arm.policy
