"""Session 31: why the scanned NVFP4 stack and each layer's own call differed (H100).

Each variant runs in a fresh process and prints, per layer, how many outputs differ
between `qjax.layer_of` in a scan and the layer's own `qjax.matmul`, with hashes of the
two compiled programs (their texts go to $OUT). "junk_copies" (GPU memory used and freed
before the inputs are copied and the programs compiled) made XLA's fusion autotuner emit
the K splits' reduce of the layer's own call as a Triton block-level fusion instead of a
loop fusion; two outputs of 6144 then rounded one bf16 unit apart. With the splits added
in order (pallas_kernels.common.sum_splits) every variant prints [0, 0, 0].
Run from the repository root on a Hopper GPU: PYTHONPATH=$PWD python3 THIS_FILE
"""
import hashlib, os, subprocess, sys
VARIANT = sys.argv[1] if len(sys.argv) > 1 else None
if VARIANT is None:
  for v in ("test", "junk", "junk_keep", "junk_copies", "junk_after"):
    r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True)
    print(v, "|", " ".join(l for l in r.stdout.splitlines()), r.stderr[-300:] if r.returncode else "", flush=True)
  sys.exit()
import jax, jax.numpy as jnp, numpy as np
import qjax
from tests.test_fp4_nk import make_case, _scanned, reference
def h(t): return hashlib.sha1(t.encode()).hexdigest()[:8]
name = "tests/test_fp4_nk.py::test_wgmma_layer_of_equals_each_layer[nvfp4]"
layers, k, n = 3, 2048, 384
x, w, stack = make_case(name, 16, k, n, "nvfp4", lead=(layers,))
if "ref_first" in VARIANT:
  for i in range(layers):
    reference(x, jax.tree.map(lambda a, i=i: a[i], w))
def junk(keep):
  rng = np.random.default_rng(7)
  arrs = []
  for _ in range(int(rng.integers(1, 12))):
    size = int(rng.choice([1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 3 << 20, 5000, 77777]))
    kind = int(rng.integers(0, 3))
    v = rng.standard_normal(size).astype(np.float32) * [1.0, 1e3, 1e-3][kind]
    if kind == 2: v[::7] = np.nan
    arrs.append(jnp.asarray(v))
  if not keep:
    for j in arrs[::2]: j.delete()
  return arrs
if VARIANT.startswith("junk") and VARIANT != "junk_after":
  held = junk("keep" in VARIANT)
if "copies" in VARIANT:
  x = jnp.array(x, copy=True)
  stack = jax.tree.map(lambda a: jnp.array(a, copy=True), stack)
fn = jax.jit(_scanned, static_argnums=2)
if VARIANT == "junk_after":
  fn.lower(stack, x, layers).compile()
  held = junk(False)
one = jax.jit(lambda a, b: qjax.matmul(a, b, implementation="pallas"))
for rep in range(2 if VARIANT == "test_twice" else 1):
  ys = np.asarray(fn(stack, x, layers).astype(jnp.float32))
  out = []
  for i in range(layers):
    layer = jax.tree.map(lambda a, i=i: a[i], stack)
    y2 = np.asarray(one(x, layer).astype(jnp.float32))
    out.append(int((ys[i] != y2).sum()))
  c1 = fn.lower(stack, x, layers).compile().as_text()
  c2 = one.lower(x, jax.tree.map(lambda a: a[0], stack)).compile().as_text()
  o = os.environ.get("OUT", "/tmp")
  open(f"{o}/{VARIANT}_scan.txt", "w").write(c1); open(f"{o}/{VARIANT}_one.txt", "w").write(c2)
  print("differing per layer", out, "scan", h(c1), "one", h(c2), "y0", hashlib.sha1(ys.tobytes()).hexdigest()[:8])
