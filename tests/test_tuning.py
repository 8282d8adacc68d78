"""The tuning table: KernelConfig validation, M buckets, the table file's merge and
lookup, and the tables shipped in qjax/data/tuning (every entry legal for its shape as
it stands, so the dispatcher runs exactly what the tuner measured)."""

import json

import pytest

import qjax
from qjax._src import tuning


def test_kernel_config_rejects_bad_fields_by_name():
  with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
    qjax.KernelConfig(block_m=16, block_n=48, block_k=128)
  with pytest.raises(ValueError, match="split_k=0 must be a positive int"):
    qjax.KernelConfig(block_m=16, block_n=64, block_k=128, split_k=0)
  with pytest.raises(ValueError, match="num_warps=True must be a positive int"):
    qjax.KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=True)
  with pytest.raises(ValueError, match="ptx_scales=1 must be True or False"):
    qjax.KernelConfig(block_m=16, block_n=64, block_k=128, ptx_scales=1)
  cfg = qjax.KernelConfig(block_m=1, block_n=64, block_k=256, split_k=7, num_stages=1)
  assert qjax.KernelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_kernel_config_ptx_scales_round_trips_and_is_optional_in_json():
  cfg = qjax.KernelConfig(block_m=16, block_n=64, block_k=256, ptx_scales=True)
  assert cfg.to_json()["ptx_scales"] is True
  assert qjax.KernelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
  plain = qjax.KernelConfig(block_m=16, block_n=64, block_k=256)
  assert "ptx_scales" not in plain.to_json()  # the tables written before it stay valid
  assert qjax.KernelConfig.from_json(plain.to_json()) == plain and not plain.ptx_scales


@pytest.mark.parametrize("m,bucket", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (64, 64),
                                      (65, 128), (2048, 2048), (5000, 4096)])
def test_m_bucket(m, bucket):
  assert tuning.m_bucket(m) == bucket


def test_write_table_merges_and_lookup_reads_it(tmp_path, monkeypatch):
  monkeypatch.setattr(tuning, "DATA_DIR", tmp_path)
  tuning._table.cache_clear()
  kind = "Test GPU 80GB"
  cfg_a = qjax.KernelConfig(block_m=1, block_n=64, block_k=128, split_k=4, num_stages=1)
  cfg_b = qjax.KernelConfig(block_m=16, block_n=128, block_k=256, split_k=2)
  entry = lambda m, cfg, us: {"format": "int4", "m_bucket": m, "k": 4096, "n": 4096,
                              "config": cfg.to_json(), "us": us}
  path = tuning.write_table(kind, [entry(1, cfg_a, 7.0)])
  assert path == tmp_path / "test_gpu_80gb.json"
  tuning.write_table(kind, [entry(16, cfg_b, 12.0)])  # merged, not replaced
  assert tuning.lookup(kind, "int4", 1, 4096, 4096) == cfg_a
  assert tuning.lookup(kind, "int4", 9, 4096, 4096) == cfg_b  # M 9 is in bucket 16
  assert tuning.lookup(kind, "int4", 1, 4096, 14336) is None
  assert tuning.lookup("Other GPU", "int4", 1, 4096, 4096) is None
  tuning.write_table(kind, [entry(1, cfg_b, 6.0)])  # same key: the new entry wins
  assert tuning.lookup(kind, "int4", 1, 4096, 4096) == cfg_b
  assert len(json.loads(path.read_text())["entries"]) == 2
  assert not list(tmp_path.glob("*.tmp"))
  tuning._table.cache_clear()


def _shipped_entries():
  for path in sorted(tuning.DATA_DIR.glob("*.json")):
    for entry in json.loads(path.read_text())["entries"]:
      yield path.name, entry


def test_shipped_tables_are_legal_as_they_stand():
  """Each shipped config parses and is already legal for its shape: the kernels'
  legalization (K-tiles per step, split-K dividing the steps) leaves it unchanged."""
  from pallas_kernels import int4_gemv, int4_matmul  # pylint: disable=g-import-not-at-top
  entries = list(_shipped_entries())
  assert entries, "no tuning table shipped"
  keys = set()
  for name, e in entries:
    key = (name, e["format"], e["m_bucket"], e["k"], e["n"])
    assert key not in keys, key
    keys.add(key)
    cfg = tuning.CONFIG_TYPES[e["format"]].from_json(e["config"])
    assert e["us"] > 0
    assert e["m_bucket"] in tuning.M_BUCKETS
    if isinstance(cfg, tuning.WgmmaConfig):
      # The wgmma kernel runs it as it stands at every M of the bucket (bench's weights:
      # INT4 groups of 128), and the tuner's search space holds it.
      from pallas_kernels import int4_wgmma as kw  # pylint: disable=g-import-not-at-top
      w = kw.abstract_table_weight(e["format"], e["k"], e["n"])
      low = tuning.M_BUCKETS[tuning.M_BUCKETS.index(e["m_bucket"]) - 1] + 1 \
          if e["m_bucket"] > 1 else 1
      for m in (low, e["m_bucket"]):
        assert kw.config_error(m, w, cfg) is None, (key, m, cfg)
      assert cfg in kw.candidate_configs(e["m_bucket"], w), (key, cfg)
      continue
    if e["format"] not in ("int4", "mxfp4", "nvfp4"):
      continue
    # The FP4 kernels share the INT4 GEMV's loop shape and the tiled kernel's legalize.
    if e["m_bucket"] == 1:
      assert cfg.block_m == 1, (key, cfg)  # routes to the GEMV kernel
      tiles = -(-e["k"] // qjax.NATIVE_TILE_K)
      tps, split, steps = int4_gemv.loop_shape(cfg, tiles)
      assert (qjax.NATIVE_TILE_K * tps, split) == (cfg.block_k, cfg.split_k), (key, cfg)
      assert tps * split * steps == tiles
    else:
      # Tiles of at least the mma's 16 rows, a power of two; M may span several row blocks
      # (INT4 takes 32-row blocks up to M = 64, where its x sum runs as a dot).
      assert cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0, (key, cfg)
      if e["format"] != "int4":
        assert cfg.block_m >= e["m_bucket"] or cfg.block_m >= 64, (key, cfg)
      assert int4_matmul.legalize(cfg, e["k"], qjax.NATIVE_TILE_K) == cfg, (key, cfg)


# ---------------------------------------------------------------- audit: the tuner's
# table round-trips to the kernels' lookup; malformed or stale tables are skipped with a
# warning that names the file and the entry (they were a KeyError / TypeError inside every
# matmul's trace on the device).


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
  monkeypatch.setattr(tuning, "DATA_DIR", tmp_path)
  tuning._table.cache_clear()
  yield tmp_path
  tuning._table.cache_clear()


def _entry(fmt="int4", m=4, k=256, n=128, **config):
  cfg = dict(block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=2)
  return {"format": fmt, "m_bucket": m, "k": k, "n": n, "config": {**cfg, **config},
          "us": 1.0}


def test_tuner_table_round_trips_to_lookup(table_dir, monkeypatch):
  """bench.tune keeps each (M, shape)'s fastest candidate; the file it writes reads back
  (read_table and lookup) as the same configs under the same keys."""
  import importlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  importlib.import_module("pallas_kernels")  # registers the kernels
  from qjax._src import bench, devtime  # pylint: disable=g-import-not-at-top
  from pallas_kernels import int4_matmul  # pylint: disable=g-import-not-at-top
  times = iter([7.0, 3.0, 9.0, 5.0, 2.0, 8.0] * 100)
  monkeypatch.setattr(bench.devtime, "device_time",
                      lambda *a, **kw: devtime.Timing(us=next(times), source="trace"))
  shapes, ms = [(256, 384)], [3, 16]
  entries = bench.tune(shapes, ms, "int4", calls=1, log=lambda s: None)
  kind = jax.devices()[0].device_kind
  path = table_dir / tuning.device_file_name(kind)
  expected = {}
  times = iter([7.0, 3.0, 9.0, 5.0, 2.0, 8.0] * 100)  # the same times, in the same order
  for m in ms:
    cands = int4_matmul.int4_candidate_configs(m, 256, 384)
    t = [next(times) for _ in cands]
    expected[("int4", tuning.m_bucket(m), 256, 384)] = cands[t.index(min(t))]
  assert [(e["format"], e["m_bucket"], e["k"], e["n"]) for e in entries] == list(expected)
  assert tuning.read_table(path) == expected
  for (fmt, bucket, k, n), cfg in expected.items():
    assert tuning.lookup(kind, fmt, bucket, k, n) == cfg


@pytest.mark.parametrize("fmt,x_rows", [("int4", 3), ("nvfp4", 3), ("int4", 17)])
def test_kernel_uses_the_table_entry_of_its_key_else_its_heuristic(table_dir, monkeypatch,
                                                                   fmt, x_rows):
  """The kernel asks the table for (this device kind, its format, M's bucket, K, N): a
  table entry at M = 3 (bucket 4) is launched as it stands; M = 17 (bucket 32, not in the
  table) gets the heuristic's config."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels import common, int4_matmul  # pylint: disable=g-import-not-at-top
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  kind = jax.devices()[0].device_kind
  tuned = dict(block_m=16, block_n=32, block_k=256, split_k=1, num_warps=2, num_stages=1)
  tuning.write_table(kind, [_entry(fmt, 4, 256, 128, **tuned),
                            _entry(fmt, 4, 256, 256), _entry("mxfp4" if fmt == "int4" else
                                                             "int4", 32, 256, 128)])
  launched = []

  class Launched(Exception):
    pass

  def launch(kernel, args, *, config, **kw):
    launched.append(config)
    raise Launched

  monkeypatch.setattr(common, "launch", launch)
  x = jnp.ones((x_rows, 256), jnp.bfloat16)
  w = bench.random_weight(fmt, 256, 128, jax.random.key(0))
  with pytest.raises(Launched):
    qjax.matmul(x, w, implementation="interpret")
  if x_rows == 3:
    assert launched == [qjax.KernelConfig(**tuned)]
  else:
    assert launched == [int4_matmul.legalize(int4_matmul.heuristic_config(17, 256, 128),
                                             256, qjax.NATIVE_TILE_K)]


@pytest.mark.parametrize("entry,message", [
    (_entry(fmt="q4_k"), "format 'q4_k' is not one the kernels look up"),
    # int4nk entries hold the wgmma kernel's config, not the Triton kernels'.
    (_entry(fmt="int4nk"), "unknown WgmmaConfig field(s) 'block_m', 'block_n', 'block_k', "
     "'num_warps', 'num_stages'; known: tile_n,"),
    ({**_entry(fmt="mxfp4nk"), "config": {"tile_n": 96}}, "WgmmaConfig.tile_n=96 must be 64 "
     "or 128"),
    (_entry(m=3), "m_bucket=3 is not one of the buckets"),
    (_entry(k="256"), "k='256' must be a positive int"),
    (_entry(block_x=4), "unknown KernelConfig field(s) 'block_x'; known: block_m,"),
    (_entry(block_n=48), "KernelConfig.block_n=48 must be a power of two"),
    (_entry(ptx_scales="false"), "KernelConfig.ptx_scales='false' must be True or False"),
    (_entry(split_k=True), "KernelConfig.split_k=True must be a positive int"),
    (_entry(block_k=128.5), "KernelConfig.block_k=128.5 must be a positive int"),
    ({k: v for k, v in _entry().items() if k != "config"}, "field(s) 'config' missing"),
    ({**_entry(), "config": {"block_m": 16}}, "field(s) 'block_n', 'block_k' missing"),
    (["int4", 4], "an entry must be a JSON object, got list"),
])
def test_bad_entry_is_skipped_with_a_warning_naming_file_and_entry(table_dir, entry,
                                                                   message):
  path = table_dir / "test_gpu.json"
  good = _entry(m=16, block_n=128)
  path.write_text(json.dumps({"device_kind": "Test GPU", "entries": [good, entry]}))
  with pytest.warns(UserWarning) as record:
    assert tuning.lookup("Test GPU", "int4", 16, 256, 128) == qjax.KernelConfig.from_json(
        good["config"])
    assert tuning.lookup("Test GPU", "int4", 4, 256, 128) is None
  assert len(record) == 1  # once: the table is read once per device kind
  text = str(record[0].message)
  assert text.startswith(f"tuning table {path}: entry 1 (") and message in text, text
  assert "ignored" in text and "Fix or delete the entry" in text


@pytest.mark.parametrize("body", ["{not json", '["int4"]', '{"entries": {}}', "\xff"])
def test_file_that_is_not_a_table_is_ignored_with_a_warning(table_dir, body):
  path = table_dir / "test_gpu.json"
  path.write_bytes(body.encode("latin-1"))
  with pytest.warns(UserWarning, match=f"tuning table {path}: .*; ignored, the kernels use "
                    "their heuristics on this device"):
    assert tuning.lookup("Test GPU", "int4", 1, 256, 128) is None


def test_write_table_leaves_a_bad_table_alone_and_names_it(table_dir):
  """Merging into a file with an entry it cannot read raised KeyError (or rewrote it);
  now a ValueError that names the file and the entry, the file unchanged."""
  path = table_dir / "test_gpu.json"
  body = json.dumps({"device_kind": "Test GPU", "entries": [_entry(), {"format": "int4"}]})
  path.write_text(body)
  with pytest.raises(ValueError, match=f"tuning table {path} entry 1 .*field\\(s\\) "
                     "'m_bucket', 'k', 'n', 'config' missing; fix or delete it"):
    tuning.write_table("Test GPU", [_entry(m=16)])
  assert path.read_text() == body
  with pytest.raises(ValueError, match="new entry 0 .*format 'int5'"):
    tuning.write_table("Other GPU", [_entry(fmt="int5")])
  assert not (table_dir / "other_gpu.json").exists()


def test_lookup_of_a_format_no_table_holds_is_none(table_dir):
  """A kernel asking for a format no table can hold (a registered subclass's own
  format_name) gets None, its heuristics; an entry of that format is refused at write."""
  tuning.write_table("Test GPU", [_entry()])
  assert tuning.lookup("Test GPU", "int4", 4, 256, 128) is not None
  assert tuning.lookup("Test GPU", "int4nk", 4, 256, 128) is None


def test_wgmma_config_round_trips_the_table(table_dir):
  """int4nk / mxfp4nk / nvfp4nk entries hold a WgmmaConfig: written, read back and
  looked up as the same config, next to a KernelConfig entry of another format."""
  wg = tuning.WgmmaConfig(tile_n=128, tile_m=8, tile_k=256, stages=4, epi_m=8, split_k=2,
                          scale_accumulator=True, mma_sync=True)
  assert tuning.WgmmaConfig.from_json(json.loads(json.dumps(wg.to_json()))) == wg
  assert tuning.WgmmaConfig.from_json({"tile_k": 128}) == tuning.WgmmaConfig(tile_k=128)
  entries = [{"format": fmt, "m_bucket": 1, "k": 4096, "n": 4096, "config": wg.to_json(),
              "us": 5.9} for fmt in ("int4nk", "mxfp4nk", "nvfp4nk")]
  tuning.write_table("Test GPU", entries + [_entry(m=1, k=4096, n=4096)])
  for fmt in ("int4nk", "mxfp4nk", "nvfp4nk"):
    assert tuning.lookup("Test GPU", fmt, 1, 4096, 4096) == wg
  assert isinstance(tuning.lookup("Test GPU", "int4", 1, 4096, 4096), qjax.KernelConfig)
  assert tuning.lookup("Test GPU", "int4nk", 2, 4096, 4096) is None


def test_tuner_passes_over_a_fast_config_that_computes_something_else():
  """bench.tune writes the fastest config whose output matches the XLA path's: a faster
  one that is wrong is passed over (and logged), and none at all is written when every
  one is wrong."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from qjax._src import bench, dispatch  # pylint: disable=g-import-not-at-top
  w = bench.random_weight("int4", 256, 128, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (3, 256), jnp.float32).astype(jnp.bfloat16)
  off = {"wrong": 1.05, "right": 1.0, "close": 1.004}  # relative errors ~5e-2, 0, ~4e-3

  def fn(x_, w_, *, interpret, config):
    return dispatch.matmul(x_, w_, implementation="xla") * off[config]

  backend = dispatch.Backend(name="fake", fn=fn, supported_on=lambda d: True)
  logs = []
  assert bench._fastest_correct([(1.0, "wrong"), (2.0, "close"), (3.0, "right")], backend,
                                x, w, logs.append) == (2.0, "close")
  assert len(logs) == 1 and logs[0].startswith("  passed over wrong (1.0 us): relative "
                                               "error 4.") and "e-02 against the XLA" in logs[0]
  assert bench._fastest_correct([(1.0, "wrong")], backend, x, w, logs.append) is None
