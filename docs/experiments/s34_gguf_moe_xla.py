"""Device time of qjax.moe_matmul's XLA path on GGUF expert stacks (Qwen3-30B-A3B's expert
shape: 128 experts of 2048 x 768, top-8), against variants and a bf16 stack.

Variants of the gathered (decode) path: "einsum" (moe_matmul_xla: the selected experts
dequantized to x's dtype, then einsum), "reduce" (the dequantization, the multiply and the
sum over K in one XLA reduction, which reads only the packed bytes). bf16: the same gather
and einsum on a bf16 stack. Floor: the selected experts' stored bytes over 3.0 TB/s."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qjax._src import devtime
from qjax._src import gguf_formats as gf
from qjax._src import moe

E, K, N, TOP = 128, 2048, 768, 8


def random_stack(ggml_type: str, seed: int):
  cls = gf.BLOCK_FORMATS[ggml_type]
  rng = np.random.default_rng(seed)
  nb = K // cls.block_size
  raw = rng.integers(0, 256, (E, N, nb, cls.type_size), dtype=np.uint8)
  for f in cls.block_fields:
    if f.dtype == np.float16:
      v = (rng.standard_normal((E, N, nb)) * 0.01).astype(np.float16)
      raw[..., f.offset:f.offset + 2] = v.view(np.uint8).reshape(E, N, nb, 2)
  return cls.from_bytes(raw.reshape(E, N, -1), (K, N), (E,))


def reduce_path(rows, w, pair_rows, pair_experts):
  sel = jax.tree.map(lambda a: a[pair_experts], w)
  x = rows[pair_rows].astype(jnp.float32)                        # [P, K]
  return jnp.sum(x[:, :, None] * sel.dequantize(jnp.float32), axis=1).astype(rows.dtype)


def bf16_path(rows, wb, pair_rows, pair_experts):
  """moe_matmul_xla's two routes on a bf16 stack ``[E, K, N]``."""
  x = rows[pair_rows]
  if pair_experts.shape[0] < E:
    return jnp.einsum("pk,pkn->pn", x, wb[pair_experts],
                      preferred_element_type=jnp.float32).astype(rows.dtype)
  groups = moe.group_by_expert(pair_experts, E, 1)
  y = jax.lax.ragged_dot(x[groups.order], wb, groups.group_sizes,
                         preferred_element_type=jnp.float32)
  return y[moe.inverse_permutation(groups.order)].astype(rows.dtype)


def main():
  print(jax.devices()[0].device_kind, jax.__version__)
  for t in ("Q4_0", "Q4_K", "Q6_K", "Q8_0"):
    w = random_stack(t, 0)
    wb = w.dequantize(jnp.bfloat16)
    per_expert = gf.BLOCK_FORMATS[t].row_bytes(K) * N
    for tokens in (1, 4, 64):
      rng = np.random.default_rng(tokens)
      sets = []
      for _ in range(4):
        ids = np.stack([rng.choice(E, TOP, replace=False) for _ in range(tokens)])
        x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.bfloat16)
        sets.append((x, jnp.asarray(ids.reshape(-1), jnp.int32)))
      pair_rows = jnp.asarray(np.arange(tokens * TOP) // TOP, jnp.int32)
      row = {}
      for name, fn, weight in (("einsum", moe.moe_matmul_xla, w),
                               ("reduce", reduce_path, w), ("bf16", bf16_path, wb)):
        if name == "reduce" and tokens * TOP >= E:
          continue
        f = jax.jit(functools.partial(fn, pair_rows=pair_rows))
        args = [(x, weight, ids) for x, ids in sets]
        g = jax.jit(lambda x, w_, ids, f=f: f(x, w_, pair_experts=ids))
        row[name] = devtime.device_time(g, args, calls=20).us
      selected = len(np.unique(np.asarray(sets[0][1])))
      floor = selected * per_expert / 3.0e12 * 1e6
      print(f"{t} T={tokens:3d} pairs={tokens * TOP:4d} floor {floor:6.1f} us | " +
            " | ".join(f"{k} {v:7.1f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
  main()
