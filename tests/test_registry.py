"""The dispatcher's registration API, driven by formats that qjax itself does not know.

A toy 4-bit format (codes ``[K, N]`` uint8, a float32 scale per column) registers an XLA
path and kernels (``register_xla``, ``register_kernel`` with ``Backend``), which
``qjax.matmul`` must run by implementation name and by its auto rules; a transposed
variant reaches the toy kernel through ``register_repack``; an MXFP4Weight subclass
registers MoE paths (``register_moe_xla``, ``register_moe_kernel``); the toy format a
sharding rule (``register_split_rule``); a subclass inherits no registration; jitted
programs marked ``retraced_on_registration`` (a user's, flax_layers.llama's) see a later
registration. Products are checked against float64 numpy
``x @ W`` on fresh random inputs, counters record which registered function ran. The
registries are global: a fixture restores them (and drops jit traces) after every test.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import qjax
from conftest import on_gpu, rel_err
from qjax._src import dispatch, formats, fp4, moe, split_rules

K, N = 64, 48


@dataclasses.dataclass(frozen=True)
class RegistryToyWeight(formats.QuantizedWeight):
  """``W[k, n] = (codes[k, n] - 8) * scales[n]`` (leading expert axes allowed)."""
  format_name = "test_registry.toy"
  codes: jax.Array   # [..., K, N] uint8 in [0, 15]
  scales: jax.Array  # [..., N] float32
  shape: tuple[int, int] = qjax.static_field()

  def dequantize(self, dtype=jnp.float32):
    return ((self.codes.astype(jnp.float32) - 8) * self.scales[..., None, :]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class RegistryToyNKWeight(formats.QuantizedWeight):
  """The toy weight stored transposed: codes ``[N, K]``. No kernel of its own."""
  format_name = "test_registry.toy_nk"
  codes: jax.Array
  scales: jax.Array
  shape: tuple[int, int] = formats.static_field()

  def to_toy(self):
    return RegistryToyWeight(self.codes.T, self.scales, self.shape)

  def dequantize(self, dtype=jnp.float32):
    return self.to_toy().dequantize(dtype)


@dataclasses.dataclass(frozen=True)
class RegistryMoEWeight(fp4.MXFP4Weight):
  """MXFP4 experts under a class of their own, which has no registered MoE path."""
  format_name = "test_registry.mxfp4_experts"


@dataclasses.dataclass(frozen=True)
class RegistryToySubWeight(RegistryToyWeight):
  """A subclass of the toy format: it inherits no registration."""
  format_name = "test_registry.toy_sub"


_TOYS = (RegistryToyWeight, RegistryToyNKWeight, RegistryMoEWeight, RegistryToySubWeight)
_REGISTRIES = (dispatch._XLA, dispatch._KERNELS, dispatch._REPACKS, moe._MOE_XLA,
               moe._MOE_KERNELS, moe._AUTO_WHEN, split_rules._RULES)


@pytest.fixture(scope="module", autouse=True)
def toy_formats():
  """register_format for this module's tests only: its name registry is global."""
  for cls in _TOYS:
    qjax.register_format(cls)
  yield
  for cls in _TOYS:
    formats._FORMATS.pop(cls.format_name)


@pytest.fixture(autouse=True)
def registry():
  """Restores the registries after each test (conftest's fixture then retraces the
  jitted kernel calls, which the restore bypasses)."""
  dispatch.load_plugins()  # pallas_kernels' own registrations belong to the snapshot
  saved = [{k: list(v) if isinstance(v, list) else v for k, v in r.items()}
           for r in _REGISTRIES]
  yield
  for r, s in zip(_REGISTRIES, saved):
    r.clear()
    r.update(s)


def toy(rng, lead=()):
  codes = rng.integers(0, 16, (*lead, K, N), dtype=np.uint8)
  scales = (rng.uniform(0.5, 1.5, (*lead, N)) / np.sqrt(K)).astype(np.float32)
  return RegistryToyWeight(jnp.asarray(codes), jnp.asarray(scales), (K, N))


def ref(x, w):
  """float64 ``x @ W``, W rebuilt in numpy from the codes and scales."""
  wd = (np.asarray(w.codes, np.float64) - 8) * np.asarray(w.scales, np.float64)[..., None, :]
  return np.asarray(x, np.float64) @ wd


def xla_path(log):
  def fn(x2, w):
    log.append(x2.shape[0])
    return formats.dense_dot(x2, w.dequantize())
  return fn


def kernel(log, tag="kernel"):
  """A stand-in kernel: the product in float32, recording (tag, weight class, interpret)."""
  def fn(x2, w, *, interpret, config=None):
    log.append((tag, type(w), interpret))
    return jnp.dot(x2.astype(jnp.float32), w.dequantize(),
                   precision=jax.lax.Precision.HIGHEST).astype(x2.dtype)
  return fn


def gpu_only(device):
  return device.platform == "gpu"


def normal(rng, m, dtype):
  return jnp.asarray(rng.standard_normal((m, K)), dtype)


def close(y, x, w, dtype):
  assert y.shape == (x.shape[0], N) and y.dtype == jnp.dtype(dtype)
  assert rel_err(y, ref(x, w)) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_new_format_runs_each_registered_path(rng):
  """(a) "xla" runs the registered XLA fn, (b) "interpret" / "pallas" the kernel's fn (its
  ``interpret`` flag set by name), (c) None on a CPU the XLA path (GPU-only kernel)."""
  w, x = toy(rng), normal(rng, 5, jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="no XLA implementation"):
    qjax.matmul(x, w, implementation="xla")
  with pytest.raises(NotImplementedError, match="no Pallas kernel is registered"):
    qjax.matmul(x, w, implementation="interpret")
  xla_log, k_log = [], []
  qjax.register_xla(RegistryToyWeight, xla_path(xla_log))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy_gpu", kernel(k_log), gpu_only))
  close(qjax.matmul(x, w, implementation="xla"), x, w, jnp.bfloat16)
  assert xla_log == [5] and k_log == []
  assert qjax.implementation_name(w, "interpret") == "toy_gpu-interpret"
  close(qjax.matmul(x, w, implementation="interpret"), x, w, jnp.bfloat16)
  assert xla_log == [5] and k_log == [("kernel", RegistryToyWeight, True)]
  if on_gpu():
    close(qjax.matmul(x, w, implementation="pallas"), x, w, jnp.bfloat16)
    assert k_log[-1] == ("kernel", RegistryToyWeight, False)
  else:
    with pytest.raises(NotImplementedError, match="toy_gpu kernel .* does not run on"):
      qjax.matmul(x, w, implementation="pallas")
    assert qjax.implementation_name(w, m=5) == "xla"
    close(qjax.matmul(x[:3], w), x[:3], w, jnp.bfloat16)
    assert xla_log == [5, 3] and len(k_log) == 1


def test_auto_honours_backend_rules(rng):
  """(d) Backend.auto_runs_xla: float32 x, more rows than auto_max_m, auto_prefers_xla;
  matmul(implementation=None) runs what it says, with a kernel that runs here."""
  w = toy(rng)
  asked = []
  prefers = lambda m, w_: asked.append((m, type(w_))) or m == 2
  plain = qjax.Backend("plain", kernel([]), lambda d: True)
  assert not plain.auto_runs_xla(10**6, w, jnp.bfloat16) and plain.auto_runs_xla(1, w, "float32")
  xla_log, k_log = [], []
  ruled = qjax.Backend("ruled", kernel(k_log), lambda d: True, auto_max_m=4,
                       auto_prefers_xla=prefers)
  qjax.register_xla(RegistryToyWeight, xla_path(xla_log))
  qjax.register_kernel(RegistryToyWeight, ruled)
  cases = ((1, jnp.bfloat16, False), (2, jnp.bfloat16, True), (4, jnp.float16, False),
           (5, jnp.bfloat16, True), (3, jnp.float32, True), (3, jnp.bfloat16, False))
  for m, dtype, runs_xla in cases:
    assert ruled.auto_runs_xla(m, w, dtype) == runs_xla, (m, dtype)
    assert qjax.implementation_name(w, m=m, dtype=dtype) == ("xla" if runs_xla else "ruled")
    xla_log.clear(), k_log.clear()
    x = normal(rng, m, dtype)
    close(qjax.matmul(x, w), x, w, dtype)
    kernel_ran = [("kernel", RegistryToyWeight, False)]
    assert (xla_log, k_log) == (([m], []) if runs_xla else ([], kernel_ran)), (m, dtype)
  assert (2, RegistryToyWeight) in asked and all(m <= 4 for m, _ in asked)


def test_later_registration_of_a_name_replaces_it(rng):
  """(e) register_kernel with a name already registered: one backend of that name, the
  later fn, is what runs (in a call traced after the replacement)."""
  w, log = toy(rng), []
  qjax.register_xla(RegistryToyWeight, xla_path([]))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy", kernel(log, "first"), gpu_only))
  x = normal(rng, 3, jnp.bfloat16)
  close(qjax.matmul(x, w, implementation="interpret"), x, w, jnp.bfloat16)
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy", kernel(log, "second"), gpu_only))
  assert [b.name for b in dispatch.kernels_for_format(RegistryToyWeight)] == ["toy"]
  x = normal(rng, 6, jnp.bfloat16)  # a fresh trace
  close(qjax.matmul(x, w, implementation="interpret"), x, w, jnp.bfloat16)
  assert [tag for tag, _, _ in log] == ["first", "second"]


def test_replacement_reaches_an_already_traced_call(rng):
  """The kernel calls are jitted (dispatch._kernel_matmul); a registration retraces them,
  so the same call, eager or inside a new jit, runs the kernel registered last. (Before
  session 28 the first trace kept running the first kernel.)"""
  w, log, x = toy(rng), [], normal(rng, 3, jnp.bfloat16)
  qjax.register_xla(RegistryToyWeight, xla_path([]))
  for tag in ("first", "second"):
    qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy", kernel(log, tag), gpu_only))
    close(qjax.matmul(x, w, implementation="interpret"), x, w, jnp.bfloat16)
    close(jax.jit(lambda a, b: qjax.matmul(a, b, implementation="interpret"))(x, w),
          x, w, jnp.bfloat16)
  # Each kernel traced once: between registrations the eager call's trace serves the jit.
  assert [tag for tag, _, _ in log] == ["first", "second"]


def test_replacing_a_backend_keeps_its_place(rng):
  """The first registered kernel is the default of "interpret" / "pallas"; registering
  another and then the first again (a new version of it) keeps the first the default."""
  w, log, x = toy(rng), [], normal(rng, 5, jnp.bfloat16)
  qjax.register_xla(RegistryToyWeight, xla_path([]))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("a", kernel(log, "a1"), gpu_only))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("b", kernel(log, "b"), gpu_only))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("a", kernel(log, "a2"), gpu_only))
  assert [b.name for b in dispatch.kernels_for_format(RegistryToyWeight)] == ["a", "b"]
  assert qjax.implementation_name(w, "interpret") == "a-interpret"
  close(qjax.matmul(x, w, implementation="interpret"), x, w, jnp.bfloat16)
  assert [tag for tag, _, _ in log] == ["a2"]


def test_repack_routes_to_the_target_kernel(rng):
  """(f) A format without kernels runs the target format's kernel on the repacked weight,
  equal to its own XLA path; a kernel registered for it directly takes precedence."""
  base = toy(rng)
  w = RegistryToyNKWeight(base.codes.T, base.scales, (K, N))
  xla_log, k_log, repacked = [], [], []
  qjax.register_xla(RegistryToyNKWeight, xla_path(xla_log))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy_gpu", kernel(k_log), gpu_only,
                                                       auto_prefers_xla=lambda m, w_: True))
  qjax.register_repack(RegistryToyNKWeight, RegistryToyWeight,
                       lambda x2, w_: repacked.append(type(w_)) or (x2, w_.to_toy()))
  assert dispatch.kernels_for_format(RegistryToyNKWeight)[0].auto_prefers_xla is None
  x = normal(rng, 7, jnp.float32)
  want = qjax.matmul(x, w, implementation="xla")
  close(want, x, base, jnp.float32)
  assert qjax.implementation_name(w, "interpret") == "toy_gpu-interpret"
  y = qjax.matmul(x, w, implementation="interpret")
  assert k_log == [("kernel", RegistryToyWeight, True)] and repacked == [RegistryToyNKWeight]
  assert rel_err(y, want) < 1e-6 and xla_log == [7]
  own = []
  qjax.register_kernel(RegistryToyNKWeight, qjax.Backend("own", kernel(own), gpu_only))
  close(qjax.matmul(x[:2], w, implementation="interpret"), x[:2], base, jnp.float32)
  assert own == [("kernel", RegistryToyNKWeight, True)] and len(k_log) == 1


def test_moe_registration(rng):
  """(g) register_moe_xla / register_moe_kernel give a new MoE format class its paths:
  fn(rows, w, pair_rows, pair_experts) per (token, selected expert) pair."""
  w = qjax.quantize_mxfp4(jnp.asarray(rng.standard_normal((4, K, N)) / 8, jnp.float32))
  w, wd = RegistryMoEWeight(w.codes, w.scales, w.shape, w.tile_k), np.asarray(w.dequantize())
  x = normal(rng, 5, jnp.float32)
  ids = jnp.asarray(rng.integers(0, 4, (5, 2)), jnp.int32)
  want = np.einsum("tk,tjkn->tjn", np.asarray(x, np.float64), wd[np.asarray(ids)])
  with pytest.raises(NotImplementedError, match="no XLA MoE implementation is registered for "
                     r"RegistryMoEWeight \(MXFP4Weight, a base class, has one, but "
                     r".*qjax.register_moe_xla\(RegistryMoEWeight, ...\)"):
    qjax.moe_matmul(x, w, ids, implementation="xla")
  xla_log, k_log = [], []

  def moe_xla(rows, w_, pair_rows, pair_experts):
    xla_log.append((type(w_), pair_rows.shape[0]))
    return moe.moe_matmul_xla(rows, w_, pair_rows, pair_experts)

  def moe_kernel(rows, w_, pair_rows, pair_experts, *, interpret, config=None):
    k_log.append((type(w_), interpret))
    y = jnp.einsum("pk,pkn->pn", rows[pair_rows], w_.dequantize(jnp.float32)[pair_experts],
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(rows.dtype)

  qjax.register_moe_xla(RegistryMoEWeight, moe_xla)
  qjax.register_moe_kernel(RegistryMoEWeight, qjax.Backend("toy_moe", moe_kernel, gpu_only))
  assert rel_err(qjax.moe_matmul(x, w, ids, implementation="xla"), want) < 1e-5
  assert xla_log == [(RegistryMoEWeight, 10)] and k_log == []
  for impl in ("interpret", "interpret:toy_moe"):
    assert qjax.moe_implementation_name(w, impl) == "toy_moe-interpret"
    assert rel_err(qjax.moe_matmul(x, w, ids, implementation=impl), want) < 1e-5
  assert k_log == [(RegistryMoEWeight, True)] * 2
  if not on_gpu():
    assert qjax.moe_implementation_name(w, None, 10) == "xla"


def test_moe_xla_of_an_unrelated_format(rng):
  """A format that is no MXFP4 subclass gets moe_matmul through register_moe_xla (before
  session 28 moe_matmul took only its built-in formats), and arrays without one shared
  leading expert axis are refused by name."""
  w = toy(rng, lead=(3,))
  qjax.register_moe_xla(RegistryToyWeight, lambda rows, w_, pr, pe: jnp.einsum(
      "pk,pkn->pn", rows[pr], w_.dequantize(rows.dtype)[pe]))
  x, ids = normal(rng, 2, jnp.float32), jnp.array([[0], [2]])
  y = qjax.moe_matmul(x, w, ids, implementation="xla")
  assert rel_err(y[:, 0], ref(x, w)[[0, 2], [0, 1]]) < 1e-5  # x[t] @ W[ids[t]]
  bad = dataclasses.replace(w, scales=w.scales[:2])
  with pytest.raises(ValueError, match="share one leading expert axis"):
    qjax.moe_matmul(x, bad, ids, implementation="xla")


def test_split_rule_is_used(rng):
  """(h) register_split_rule: check_split, partition_specs and sharded_matmul take the
  format's fields and K unit from the registered rule."""
  w, seen, local = toy(rng), [], []
  with pytest.raises(TypeError, match="RegistryToyWeight has no sharding rule"):
    qjax.check_split(w, "column", 2)

  qjax.register_split_rule(RegistryToyWeight, lambda static: seen.append(dict(static)) or (
      split_rules.SplitRule(
          fields=(("codes", split_rules.MATRIX), ("scales", split_rules.FieldAxes(1, None, -1))),
          k_unit=16, k_unit_why="whole 16-row toy blocks")))
  qjax.register_xla(RegistryToyWeight,
                    lambda x2, w_: local.append(w_.codes.shape) or formats.dense_dot(
                        x2, w_.dequantize()))
  qjax.check_split(w, "row", 4)
  with pytest.raises(ValueError, match="multiple of 16 rows .whole 16-row toy blocks"):
    qjax.check_split(w, "row", 8)
  assert {"shape": (K, N)} in seen
  specs = qjax.partition_specs(w, "row", "tp")
  assert (specs.codes, specs.scales) == (P("tp", None), P(None))
  specs = qjax.partition_specs(w, "column", "tp")
  assert (specs.codes, specs.scales) == (P(None, "tp"), P("tp"))
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (conftest's XLA_FLAGS)")
  x, mesh = normal(rng, 3, jnp.float32), Mesh(np.array(jax.devices()[:4]), ("tp",))
  for mode, shape in (("row", (K // 4, N)), ("column", (K, N // 4))):
    local.clear()
    close(qjax.sharded_matmul(x, w, mesh, "tp", mode, implementation="xla"), x, w,
          jnp.float32)
    assert local == [shape], mode


def test_subclass_inherits_no_registration(rng):
  """Registrations are per class (a subclass may store another layout): a subclass of a
  registered format gets no path, and the error names the base that has one and the call
  that registers the subclass."""
  base = toy(rng)
  w = RegistryToySubWeight(base.codes, base.scales, base.shape)
  x = normal(rng, 3, jnp.float32)
  qjax.register_xla(RegistryToyWeight, xla_path([]))
  qjax.register_kernel(RegistryToyWeight, qjax.Backend("toy", kernel([]), gpu_only))
  with pytest.raises(NotImplementedError, match=r"no XLA implementation is registered for "
                     r"RegistryToySubWeight \(RegistryToyWeight, a base class, has one.*"
                     r"qjax.register_xla\(RegistryToySubWeight, ...\)"):
    qjax.matmul(x, w, implementation="xla")
  with pytest.raises(NotImplementedError, match=r"no Pallas kernel is registered for "
                     r"RegistryToySubWeight \(RegistryToyWeight, .*"
                     r"qjax.register_kernel\(RegistryToySubWeight, ...\)"):
    qjax.matmul(x, w, implementation="interpret")
  with pytest.raises(NotImplementedError, match=r"registered for RegistryToyNKWeight$"):
    qjax.matmul(x, RegistryToyNKWeight(base.codes.T, base.scales, base.shape),
                implementation="xla")  # no base with a registration: no note
  log = []
  qjax.register_xla(RegistryToySubWeight, xla_path(log))
  close(qjax.matmul(x, w, implementation="xla"), x, w, jnp.float32)
  assert log == [3]


def test_user_program_marked_retraced(rng):
  """qjax.retraced_on_registration on a program of the user's: a registration after its
  first call reaches its next call; unmarked, the old trace keeps the old XLA path."""
  w, x = toy(rng), normal(rng, 4, jnp.float32)
  first, second = [], []
  qjax.register_xla(RegistryToyWeight, xla_path(first))
  marked = qjax.retraced_on_registration(jax.jit(lambda a, b: 2 * qjax.matmul(a, b)))
  plain = jax.jit(lambda a, b: 2 * qjax.matmul(a, b))
  for fn in (marked, plain):
    close(fn(x, w) / 2, x, w, jnp.float32)
  assert first == [4, 4]
  qjax.register_xla(RegistryToyWeight, xla_path(second))
  for fn in (marked, plain):
    close(fn(x, w) / 2, x, w, jnp.float32)
  assert first == [4, 4] and second == [4]  # only the marked program traced again
  with pytest.raises(TypeError, match="takes a jax.jit function .* got function"):
    qjax.retraced_on_registration(lambda a: a)


def test_llama_programs_see_a_later_registration():
  """flax_layers.llama's prefill / decode_step / decode_and_sample are module-level jits
  (config static): a registration after their first call retraces them, so their next
  call runs the XLA path registered last, with the same outputs."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  from test_sharding import llama_case  # pylint: disable=g-import-not-at-top
  cfg, params, tokens = llama_case(scan_layers=False)  # INT4 weights, two layers
  token, pos, key = tokens[:, 0], jnp.array([5, 5], jnp.int32), jax.random.key(0)
  programs = {
      "prefill": lambda c: llama.prefill(params, tokens, c, cfg=cfg)[0],
      "decode_step": lambda c: llama.decode_step(params, token, pos, c, cfg=cfg)[0],
      "decode_and_sample": lambda c: llama.decode_and_sample(
          params, token, pos, c, key, cfg=cfg)[0],
  }
  original = dispatch._XLA[qjax.Int4Weight]
  for name, program in programs.items():
    before = np.asarray(program(llama.init_cache(cfg, 2, 16)))
    log = []
    qjax.register_xla(qjax.Int4Weight, lambda x2, w, log=log: log.append(1) or original(x2, w))
    after = np.asarray(program(llama.init_cache(cfg, 2, 16)))
    assert log, f"{name} kept its trace of the XLA path registered before"
    np.testing.assert_array_equal(after, before, err_msg=name)
    qjax.register_xla(qjax.Int4Weight, original)
