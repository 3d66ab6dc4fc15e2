"""Adapters that put AV's sampler behind serving stacks' own interfaces.

One module per stack, each with the stack's argument order and output layout, tested on
that stack's published test cases (tests/test_integrations.py):

  * `av_jax.integrations.tpu_inference`: `RejectionSampler(mesh)`, called like
    tpu-inference's (T target rows, bonus ids, `[T main | B bonus]` output).
  * `av_jax.integrations.vllm`: `rejection_sample` on vLLM's flat drafts and interleaved
    `T + B` target rows, returning vLLM's `[B, K + 1]` rows.

Both return AV's per-draft labels as well, and share `pack_drafts` (AV's plan ->
`num_draft_tokens`) and `to_dense_labels` (flat labels -> the `[B, K]` the estimator takes).
Each has a `labels_from_output` that recovers the labels from the stack's output alone,
with a per-request `learn` mask (requests whose target applies a transform the drafter
never sees get no label), and returns log-probabilities when asked, in the stack's own
`LogprobsTensors` layout.
"""

from av_jax.integrations import tpu_inference
from av_jax.integrations import vllm

__all__ = [
    "tpu_inference",
    "vllm",
]
