"""``qjax check``: the backend-consistency sweep, in a reduced form for CI.

The full reduced sweep (every format, xla + interpret) takes several minutes on a
2-core CPU; CI runs one format per family here, and the tests below show that the sweep
can fail: a wrong implementation or a crashing one is a miss and a non-zero exit.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from qjax._src import check
from qjax._src import cli

# One format per family, on both CPU implementations.
CI_FORMATS = ("int4-asym-g64-f16", "gguf_tiled-Q6_K", "gptq-v1-actorder-g32", "nvfp4")


def test_shape_list_covers_the_ranges():
  shapes = set(check.SHAPES)
  assert len(shapes) >= 50
  ms = {m for m, _, _ in shapes}
  assert min(ms) == 1 and max(ms) == 4096
  assert {2, 3, 5, 7, 13, 31, 127, 257} <= ms  # primes
  assert any(k % 128 for _, k, _ in shapes) and any(k % 128 == 0 for _, k, _ in shapes)
  assert any(n % 64 for _, _, n in shapes) and any(n % 64 == 0 for _, _, n in shapes)


def test_every_format_fits_and_builds_small():
  rng = np.random.default_rng(0)
  names = [f.name for f in check.format_cases()]
  assert len(names) == len(set(names)) >= 20
  for fmt in check.format_cases():
    k, n = fmt.fit(100, 70)
    assert k % fmt.k_multiple == 0 and n % fmt.n_multiple == 0 and k >= 100 and n >= 70
    w = fmt.build(rng, k, n)
    assert tuple(w.shape) == (k, n), fmt.name
    assert np.isfinite(np.asarray(w.dequantize())).all(), fmt.name


def test_ci_formats_pass_on_xla_and_interpret():
  results = check.run(formats=CI_FORMATS, impls=("xla", "interpret"))
  rows = check.summarize(results)
  assert {(r["format"], r["implementation"]) for r in rows} == {
      (f, i) for f in CI_FORMATS for i in ("xla", "interpret")}
  misses = [r for r in results if r.status != "ok"]
  assert not misses, misses
  assert all(0 <= r.rel_err < check.THRESHOLD for r in results)
  assert max(r.m for r in results) == 4096


def _break(monkeypatch, wrong):
  monkeypatch.setattr(check, "_matmul", lambda impl: wrong)


def test_a_wrong_implementation_is_a_miss(monkeypatch):
  import qjax
  _break(monkeypatch, lambda x, w: qjax.matmul(x, w, implementation="xla") * 1.05)
  results = check.run(formats=["int4-sym-g32"], impls=["xla"])
  assert results and all(r.status == "miss" and r.rel_err >= 0.04 for r in results)


def test_a_crashing_implementation_is_a_miss_and_exit_1(monkeypatch, tmp_path, capsys):
  def crash(x, w):
    raise RuntimeError("kernel fell over")
  _break(monkeypatch, crash)
  out = tmp_path / "check.json"
  rc = cli.main(["check", "--formats", "nvfp4", "--impl", "xla", "--json", str(out),
                 "--quiet"])
  assert rc == 1
  text = capsys.readouterr().out
  assert "MISS nvfp4 xla" in text and "kernel fell over" in text
  report = json.loads(out.read_text())
  assert report["summary"][0]["misses"] == report["summary"][0]["cases"] > 0


def test_a_declining_kernel_is_skipped_not_missed(monkeypatch):
  def decline(x, w):
    raise NotImplementedError("block_n does not divide N")
  _break(monkeypatch, decline)
  results = check.run(formats=["mxfp4"], impls=["interpret"])
  assert results and all(r.status == "skipped" for r in results)


def test_cli_table_and_exit_0(tmp_path, capsys):
  out = tmp_path / "check.json"
  rc = cli.main(["check", "--formats", "awq-g128", "--impl", "xla", "--json", str(out),
                 "--quiet"])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "awq-g128" in text and "0 misses" in text
  report = json.loads(out.read_text())
  assert {r["format"] for r in report["summary"]} == {"awq-g128"}
  assert all(c["status"] == "ok" for c in report["cases"])


def test_shards_split_the_formats(monkeypatch):
  names = [f.name for f in check.format_cases()]
  monkeypatch.setattr(check, "run_case", lambda fmt, impl, *a, **kw: check.CaseResult(
      fmt.name, impl, 0, 0, 0, "none"))
  monkeypatch.setattr(check.FormatCase, "fit", lambda self, k, n: (k, n))
  monkeypatch.setattr(check, "format_cases", lambda: [
      check.FormatCase(name, lambda rng, k, n: None, 1) for name in names])
  seen = []
  for i in range(3):
    seen += sorted({r.format for r in check.run(impls=["xla"], shard=(i, 3))})
  assert sorted(seen) == sorted(names)
  with pytest.raises(ValueError, match="shard"):
    check.run(impls=["xla"], shard=(3, 3))


def test_a_shard_without_formats_says_so(capsys):
  """--shard beyond the selected formats checks nothing: exit 0 (CI splits a sweep into
  more shards than some selections have formats), with a note on stderr."""
  rc = cli.main(["check", "--formats", "awq-g128", "--impl", "xla", "--shard", "1/2",
                 "--quiet"])
  captured = capsys.readouterr()
  assert rc == 0 and "0 cases" in captured.out
  assert "shard 1/2 holds none of the 1 formats selected; nothing was checked" in captured.err


def test_unknown_format_is_named():
  with pytest.raises(ValueError, match="unknown formats \\['int5'\\]"):
    check.run(formats=["int5"], impls=["xla"])


def test_reference_is_float64_of_the_dequantized_weight():
  fmt = {f.name: f for f in check.format_cases()}["int4-bias-g32-f16"]
  w = fmt.build(np.random.default_rng(1), 64, 8)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64)
  np.testing.assert_array_equal(check._reference(x, w), want)
