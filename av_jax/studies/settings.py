"""The studies suite's settings: everything its numbers depend on (recorded in the report).

Its own module, so that the runner (`run`) and the report (`report`) both import it and
neither imports the other.
"""

from __future__ import annotations

import dataclasses

WORKLOADS = ("code", "prose", "math", "noisy")
DRAFTERS = ("draft_lm", "eagle", "block", "block_head")


@dataclasses.dataclass
class Settings:
  """Everything the suite's numbers depend on (recorded in the report)."""
  models: str = "default"
  temperature: float = 1.0
  top_p: float = 0.95
  k: int = 8
  label_slots: int = 64            # concurrency of the labelled-draft runs
  # 4 drafters x 4 workloads x 96 steps + the drift run: ~300,000 labels with the v2
  # models (~176 labels per B = 64 step; a step of the 16M-parameter target is ~1 s on a
  # 2-core CPU, so labelling alone takes ~30 minutes there).
  label_steps: int = 96            # decode steps per (drafter, workload) stream
  label_drafters: tuple = DRAFTERS
  prompt_len: int = 32
  label_max_new: int = 48          # output limit per request in labelled runs
  refit_interval: int = 16         # estimator round length N (steps)
  drift_workloads: tuple = ("math", "prose", "math")
  drift_steps: int = 96            # steps per drift segment (a multiple of refit_interval)
  drift_drafter: str = "block"
  warmup_rounds: int = 1           # served predictions of the first rounds are warm-up
  concurrencies: tuple = (1, 16, 64)
  pareto_ks: tuple = (0, 1, 2, 4, 6, 8)
  pareto_drafter: str = "block"
  # AV on/off per drafter kind on mixed (block_head drafts what block drafts: its head
  # changes nothing AV does, so its throughput is block's)
  on_off_drafters: tuple = ("draft_lm", "eagle", "block")
  per_workload_drafter: str = "block"
  per_workload: bool = True        # the on/off sweep of per_workload_drafter per workload
  requests_per_slot: int = 1       # throughput requests = max(4, this * concurrency)
  throughput_max_new: int = 32
  repeats: int = 2
  # Arms beyond fixed K and AV: vLLM's batch-level confidence stop at each threshold of
  # `confstop` in the Pareto sweeps (its goal compares AV with the best of them).
  confstop: tuple = (0.5, 0.8)
  # The same Pareto arms again on a modelled accelerator clock (`av_jax.compare`
  # DEVICE:SHAPE): the engine decodes here and every step is charged the deployment's
  # roofline cost, so concurrencies beyond what this CPU serves fast are shown.
  modelled_clock: str | None = "h200:llama3-8b"
  modelled_concurrencies: tuple = (1, 16, 64, 256)
  modelled_drafters: tuple = ("eagle",)
  modelled_repeats: int = 1
  overhead_repeats: int = 30
  seed: int = 0

  def validate(self) -> "Settings":
    """Refuses settings whose served-estimator figures would be empty.

    Raises:
      ValueError: `label_steps` not beyond the warm-up (`warmup_rounds` x
        `refit_interval` steps), or `drift_steps` not a multiple of `refit_interval`.
    """
    warmup = self.warmup_rounds * self.refit_interval
    if self.label_drafters and self.label_steps <= warmup:
      raise ValueError(f"label_steps: expected more than the warm-up's {warmup} steps "
                       f"(warmup_rounds {self.warmup_rounds} x refit_interval "
                       f"{self.refit_interval}), got {self.label_steps}: no served "
                       "prediction would be scored")
    if self.drift_steps % self.refit_interval:
      raise ValueError(f"drift_steps: expected a multiple of refit_interval "
                       f"{self.refit_interval}, got {self.drift_steps}")
    return self

  @classmethod
  def quick(cls) -> "Settings":
    """A reduced suite for a few minutes on a 2-core CPU: every study, fewer points."""
    return cls(label_slots=32, label_steps=12, label_drafters=("block_head",),
               refit_interval=8, warmup_rounds=1, drift_drafter="block_head", drift_steps=16,
               concurrencies=(16,), pareto_ks=(0, 8), on_off_drafters=("block",),
               per_workload=False, confstop=(0.8,), throughput_max_new=24,
               label_max_new=24, repeats=1, overhead_repeats=10,
               modelled_concurrencies=(16,), modelled_drafters=("block",))
