"""Command-line flag types: a bad value is an argparse error naming the flag.

`argument --slots: expected an integer >= 1, got '0'` instead of a traceback from deep in
the engine. Used by `av_lab.cli`, `av_lab.synthetic_demo`, `av_lab.demo` and `av_lab.studies.run`.
"""

from __future__ import annotations

import argparse
import glob
import os

from av_jax.models import checkpoint as model_files


def checked(parse):
  """An argparse `type` from a parser that raises ValueError (message kept): the text is
  returned as given, `parse` only validates it."""
  def check(text):
    try:
      parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
    return text
  return check


def at_least(low: int):
  """An argparse type: an int >= `low`."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    if value < low:
      raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value
  parse.__name__ = f"integer >= {low}"
  return parse


def _number(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
  if value != value:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
  return value


def top_p(text: str) -> float:
  """An argparse type: a nucleus mass in (0, 1]."""
  value = _number(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"expected a nucleus mass in (0, 1], got {text!r}")
  return value


def temperature(text: str) -> float:
  """An argparse type: a temperature >= 0 (0 = greedy)."""
  value = _number(text)
  if not 0 <= value < float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite temperature >= 0 (0 = greedy), "
                                     f"got {text!r}")
  return value


def model_sets(directory: str | None = None) -> list[str]:
  """Names of the model sets shipped in `directory` (default: av_jax/assets)."""
  directory = directory or model_files.assets_dir()
  names = (os.path.basename(p)[len("tokenizer_"):-len(".json")]
           for p in glob.glob(os.path.join(directory, "tokenizer_*.json")))
  return sorted(n for n in names
                if glob.glob(os.path.join(directory, f"{glob.escape(n)}_target.*")))


def model_set(text: str) -> str:
  """An argparse type: the name of a shipped model set."""
  known = model_sets()
  if text not in known:
    raise argparse.ArgumentTypeError(f"unknown model set {text!r}; available: "
                                     f"{', '.join(known) or '(none shipped)'}")
  return text
