"""Quantize a small Flax MLP's Dense layers to int4 and compare outputs.

  python examples/quantize_dense.py
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import qjax
from flax_layers import Int4Dense, quantize_dense_params


class Mlp(nn.Module):
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    return self.dense(256, name="out")(jax.nn.gelu(self.dense(1024, name="hidden")(x)))


def main(argv=None):
  argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
  x = jax.random.normal(jax.random.key(0), (8, 512))
  params = Mlp().init(jax.random.key(1), x)["params"]
  qparams = {name: quantize_dense_params(p, group_size=128) for name, p in params.items()}
  y = Mlp().apply({"params": params}, x)
  yq = jax.jit(Mlp(dense=Int4Dense).apply)({"params": qparams}, x)
  err = float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y))
  qbytes = sum(p["kernel"].nbytes for p in qparams.values())
  fbytes = sum(p["kernel"].size * 2 for p in params.values())
  print(f"relative output error of the int4 MLP: {err:.4f}")
  print(f"kernel bytes: {qbytes:,} int4 vs {fbytes:,} bf16; implementation: "
        f"{qjax.implementation_name(qparams['hidden']['kernel'], m=8, dtype=x.dtype)}")
  assert np.isfinite(err)


if __name__ == "__main__":
  main()
