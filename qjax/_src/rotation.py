"""Seeded per-group rotations of K for codebook weights.

A weight's K axis is cut into groups of ``d`` rows (64 or 128); group ``g`` has its own
orthogonal ``d x d`` matrix ``Pi_g``. A weight group is stored rotated
(``w_rot_g = Pi_g @ w_g``, a column-wise product) and the activations are rotated instead
of the weight at inference: ``x_g . w_g = (x_g @ Pi_g^T) . w_rot_g``.

Two kinds, both rebuilt from an integer seed (the only thing a weight stores):

* ``"hadamard"``: ``Pi_g = H_d diag(s_g) / sqrt(d)`` with ``H_d`` the Sylvester Hadamard
  matrix and ``s_g`` a seeded vector of signs.
* ``"orthogonal"``: ``Pi_g`` the Q factor of a seeded Gaussian matrix (signs of R's
  diagonal folded in, so it is Haar-distributed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ROTATIONS = ("hadamard", "orthogonal")
GROUP_SIZES = (64, 128)
MAX_SEED = 2**31 - 2  # pass 2 uses seed + 1; both fit a stored int32


def check(rotation: str, group_size: int, seed: int, group_name: str = "group_size") -> None:
  """A ValueError for a rotation, group size or seed the rotations do not take;
  ``group_name`` is the group size's name in the caller's arguments."""
  if rotation not in ROTATIONS:
    raise ValueError(f"{rotation=} is not known; use one of {ROTATIONS}")
  if group_size not in GROUP_SIZES:
    raise ValueError(f"{group_name}={group_size!r} is not supported; use one of {GROUP_SIZES}")
  if not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
    raise ValueError(f"{seed=} must be an int in [0, {MAX_SEED}]")


def _sylvester(d: int) -> np.ndarray:
  """``[d, d]`` float64 Sylvester Hadamard matrix of +-1 (d a power of two)."""
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


@functools.lru_cache(maxsize=64)
def _matrices(rotation: str, d: int, num_groups: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if rotation == "hadamard":
    signs = rng.integers(0, 2, size=(num_groups, 1, d)) * 2.0 - 1.0
    mats = _sylvester(d)[None] * signs / np.sqrt(d)
  else:
    gauss = rng.standard_normal((num_groups, d, d))
    q, r = np.linalg.qr(gauss)
    mats = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
  mats = mats.astype(np.float32)
  mats.setflags(write=False)
  return mats


def matrices(rotation: str, group_size: int, num_groups: int, seed: int) -> np.ndarray:
  """``[num_groups, d, d]`` float32 ``Pi_g`` (read-only, cached)."""
  check(rotation, group_size, seed)
  return _matrices(rotation, group_size, num_groups, int(seed))


_HIGHEST = jax.lax.Precision.HIGHEST


def rotate_activations(x: jax.Array, rotation: str, group_size: int, seed: int
                       ) -> jax.Array:
  """``x [M, K] -> [M, K]`` float32, group ``g`` replaced by ``x_g @ Pi_g^T``."""
  m, k = x.shape
  g = k // group_size
  pi = jnp.asarray(matrices(rotation, group_size, g, seed))
  xg = x.astype(jnp.float32).reshape(m, g, group_size)
  return jnp.einsum("mgd,ged->mge", xg, pi, precision=_HIGHEST).reshape(m, k)


def rotate_weight(w: jax.Array, rotation: str, group_size: int, seed: int) -> jax.Array:
  """``w [K, N] -> [K // d, d, N]`` float32 with group ``g`` replaced by ``Pi_g @ w_g``."""
  k, n = w.shape
  g = k // group_size
  pi = jnp.asarray(matrices(rotation, group_size, g, seed))
  wg = w.astype(jnp.float32).reshape(g, group_size, n)
  return jnp.einsum("ged,gdn->gen", pi, wg, precision=_HIGHEST)


def unrotate_weight(w_rot: jax.Array, rotation: str, seed: int) -> jax.Array:
  """Inverse of :func:`rotate_weight`: ``[K // d, d, N] -> [K, N]`` float32."""
  g, d, n = w_rot.shape
  pi = jnp.asarray(matrices(rotation, d, g, seed))
  return jnp.einsum("ged,gen->gdn", pi, w_rot, precision=_HIGHEST).reshape(g * d, n)
