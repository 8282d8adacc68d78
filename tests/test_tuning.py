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
    cfg = qjax.KernelConfig.from_json(e["config"])
    assert e["us"] > 0
    assert e["m_bucket"] in tuning.M_BUCKETS
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
