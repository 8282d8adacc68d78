"""16-entry codebooks for rotated weight coordinates.

After a random rotation, the coordinates of a group of ``d`` weights divided by the
group's norm are those of a random unit vector in ``d`` dimensions: approximately
``N(0, 1/d)``. Multiplied by ``sqrt(d)`` they are approximately ``N(0, 1)``, which is what
the codebooks here are laid out for (a weight stores ``norm``-like scales and the
dequantized rotated group is ``codebook[idx] * norm / sqrt(d)``).

* ``"lloyd"``: the Lloyd-Max quantizer of ``N(0, 1)`` with 16 levels (the MSE-optimal
  scalar quantizer; its error is about 0.0095 of the variance), computed here by Lloyd
  iterations on the exact density.
* ``"nf4"``: the NormalFloat-4 levels of QLoRA, in ``[-1, 1]``.
* ``"iq4_nl"``: llama.cpp's IQ4_NL non-linear levels (``kvalues_iq4nl`` / 127).

The fixed tables are stored in their own units: the per-group scale absorbs the units.
"""

from __future__ import annotations

import functools
import math

import numpy as np

CODEBOOKS = ("lloyd", "nf4", "iq4_nl")

_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
_IQ4_NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _normal_pdf(t: np.ndarray) -> np.ndarray:
  return np.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _normal_cdf(t: np.ndarray) -> np.ndarray:
  return 0.5 * (1.0 + np.vectorize(math.erf)(t / math.sqrt(2.0)))


@functools.lru_cache(maxsize=None)
def lloyd_max_normal(levels: int = 16, iterations: int = 2000) -> tuple[float, ...]:
  """Levels of the Lloyd-Max quantizer of ``N(0, 1)``, ascending (float64)."""
  c = np.linspace(-2.5, 2.5, levels)
  for _ in range(iterations):
    edges = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
    lo, hi = edges[:-1], edges[1:]
    mass = _normal_cdf(hi) - _normal_cdf(lo)
    # E[z | lo < z < hi] = (pdf(lo) - pdf(hi)) / mass; pdf(+-inf) = 0.
    c = (_normal_pdf(np.where(np.isinf(lo), 0, lo)) * ~np.isinf(lo)
         - _normal_pdf(np.where(np.isinf(hi), 0, hi)) * ~np.isinf(hi)) / mass
  return tuple(float(v) for v in c)


def table(name: str) -> np.ndarray:
  """``[16]`` float32 codebook, ascending."""
  if name == "lloyd":
    values = lloyd_max_normal()
  elif name == "nf4":
    values = _NF4
  elif name == "iq4_nl":
    values = tuple(v / 127.0 for v in _IQ4_NL)
  else:
    raise ValueError(f"codebook={name!r} is not known; use one of {CODEBOOKS}")
  return np.asarray(values, np.float32)


def initial_scale_factor(codebook: np.ndarray) -> float:
  """Scale of a group of ``N(0, 1)``-like coordinates that first maps them onto the
  codebook: 1 for a codebook laid out for ``N(0, 1)`` (Lloyd-Max), the ratio of the
  Lloyd-Max outer level to the table's outer level otherwise."""
  outer = float(np.max(np.abs(codebook)))
  return lloyd_max_normal()[-1] / outer
