"""Studies: the design note's measurements on av_jax's own models (`av-jax bench`).

`collect` gathers labelled drafts and coefficient traces from engine runs, `analysis`
fits and scores predictors, `throughput` runs side-by-side speed sweeps, `report` writes
Markdown, PNG and JSON, and `run` is the suite (`python -m av_lab.studies.run`).
"""
