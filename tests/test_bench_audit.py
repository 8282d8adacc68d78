"""Audit of ``qjax bench``'s figures: the floor's byte count per format, the derived
columns (% of floor, x bf16, ceil%) in the table, the JSON and the plot, NaN cells and
their reasons, the weight rotation, and --tune's format check.

Expected values are computed here from the formats' definitions and the rows' raw times,
not by the helpers bench.py uses. Most tests replace the device timing by a fake, so
they take no measurement time; one runs the CI-sized CPU bench through the CLI.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_only
from qjax._src import bench
from qjax._src import cli
from qjax._src import devtime
from test_cli import _usage_error  # exit code 2, one "qjax CMD: error: " line

L2 = 50 * 2**20  # the H100's L2, which the rotation must exceed several times over


class FakeTime:
  """devtime.device_time's stand-in: records each call's argument sets and answers
  ``us`` (a fixed value or a callable of the call's index)."""

  def __init__(self, us=10.0):
    self.calls = []
    self.us = us

  def __call__(self, fn, arg_sets, *, calls=40, warmup=3):
    self.calls.append(arg_sets)
    us = self.us(len(self.calls) - 1) if callable(self.us) else self.us
    return devtime.Timing(us=us, source="trace")


@pytest.fixture
def fake_time(monkeypatch):
  fake = FakeTime()
  monkeypatch.setattr(bench.devtime, "device_time", fake)
  monkeypatch.setattr(bench, "_READ_US", {})
  return fake


# ---------------------------------------------------------------- the floor's bytes


def _format_bytes(fmt: str, k: int, n: int) -> int:
  """The weight's bytes from the format's definition: 4-bit codes (the [K, N] layouts
  pack K in 128-row tiles, the [N, K / 8] ones do not pad), plus its scales."""
  rows = -(-k // 128) * 128 if not fmt.endswith("nk") else k
  codes = rows * n // 2
  base = fmt[:-2] if fmt.endswith("nk") else fmt
  if base == "int4":
    return codes + (k // 128) * n * 2  # bf16 scale per group of 128
  if base == "mxfp4":
    return codes + (k // 32) * n  # E8M0 byte per block of 32
  if base == "nvfp4":
    return codes + (k // 16) * n + 4  # E4M3 byte per block of 16, float32 global scale
  passes = 2 if fmt == "codebook2" else 1
  # Per pass: bf16 norm per group of 128, a 16-entry float32 codebook, and the rotation
  # matrices [K / 128, 128, 128] float32 that rotating x reads.
  return passes * (codes + (k // 128) * n * 2 + 16 * 4 + (k // 128) * 128 * 128 * 4)


@pytest.mark.parametrize("fmt", bench.BENCH_FORMATS)
@pytest.mark.parametrize("m,k,n", [(3, 256, 384), (16, 384, 136)])
def test_floor_bytes_are_the_weights_arrays_x_and_the_output(fake_time, fmt, m, k, n):
  row = bench.bench_shape(m, k, n, fmt, bandwidth=2e9, impls=["xla"], calls=1)
  x, w = fake_time.calls[0][0]
  leaves = sum(a.nbytes for a in jax.tree.leaves(w))
  rotations = 0
  if fmt.startswith("codebook"):  # rebuilt from the seed, not a leaf (floor_weight_bytes)
    rotations = w.passes * (k // w.group_size) * w.group_size ** 2 * 4
  expected = leaves + rotations + m * k * 2 + m * n * 2
  assert x.dtype == jnp.bfloat16 and x.shape == (m, k)
  assert row.floor_bytes == expected
  assert row.floor_bytes == _format_bytes(fmt, k, n) + m * k * 2 + m * n * 2
  assert row.floor_us == pytest.approx(expected / 2e9 * 1e6, rel=1e-12)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp4nk", "nvfp4nk"])
def test_floor_counts_the_padding_of_the_kn_layouts(fake_time, fmt):
  """K = 96: the [K, N] layouts store (and their kernels read) a whole 128-row tile, each
  word holding real rows; the [N, K / 8] layouts store 96 rows."""
  k, n = 96, 128
  row = bench.bench_shape(1, k, n, fmt, bandwidth=1e9, impls=["xla"], calls=1)
  w = fake_time.calls[0][0][1]
  padded = not fmt.endswith("nk")
  assert w.codes.size * 4 == (128 if padded else 96) * n // 2
  assert row.floor_bytes == _format_bytes(fmt, k, n) + k * 2 + n * 2


def test_moe_floor_counts_the_distinct_selected_experts(fake_time):
  tokens, experts, k, n, top_k = 4, 8, 256, 128, 2
  row = bench.bench_moe(tokens, experts=experts, k=k, n=n, top_k=top_k, bandwidth=1e9,
                        on_gpu=False, calls=1)
  sets = fake_time.calls[0]
  x, w = sets[0][0], sets[0][1]
  per_expert = sum(a.nbytes for a in jax.tree.leaves(w)) / experts
  assert per_expert == k * n // 2 + (k // 32) * n  # MXFP4 codes and E8M0 scales
  distinct = np.mean([len(np.unique(np.asarray(ids))) for _, _, ids in sets])
  assert row.selected_experts == pytest.approx(distinct)
  expected = distinct * per_expert + tokens * k * 2 + tokens * top_k * n * 2
  assert row.floor_bytes == pytest.approx(expected) and x.shape == (tokens, k)
  assert row.floor_us == pytest.approx(expected / 1e9 * 1e6)


# ---------------------------------------------------------------- the weight rotation


def test_bench_rotates_distinct_weights_past_l2(fake_time):
  """Each timed call reads another copy of the weight (and bf16 another copy of its
  matrix), enough copies to exceed L2 four times (at most 32); x is the same."""
  k, n = 256, 384
  bench.bench_shape(1, k, n, "int4", bandwidth=1e9, impls=["xla", "interpret"], calls=1)
  xla_sets, interpret_sets, bf16_sets = fake_time.calls[:3]
  w_bytes = k * n // 2 + (k // 128) * n * 2
  assert len(xla_sets) == min(32, math.ceil(4 * L2 / w_bytes)) == 32
  assert interpret_sets == xla_sets
  codes = {np.asarray(w.codes).tobytes() for _, w in xla_sets}
  assert len(codes) == len(xla_sets)  # no two copies alike
  assert len({id(x) for x, _ in xla_sets}) == 1
  assert len(bf16_sets) == min(32, math.ceil(4 * L2 / (k * n * 2)))
  assert len({id(w) for _, w in bf16_sets}) == len(bf16_sets)
  assert all(w.shape == (k, n) and w.dtype == jnp.bfloat16 for _, w in bf16_sets)


@pytest.mark.parametrize("nbytes,copies", [(1, 32), (4 * L2 // 31, 32), (4 * L2 // 10, 10),
                                           (4 * L2, 2), (10 * L2, 2)])
def test_rotation_count(nbytes, copies):
  assert bench._rotation(nbytes) == copies


# ---------------------------------------------------------------- derived columns


def _cells(table: str) -> list[dict[str, str]]:
  """The table's rows as {column: cell}: the header's names ("xla xbf" as "xla_xbf"),
  the row's cells."""
  lines = table.splitlines()
  head = lines[0].replace("|", " ").replace(" xbf", "_xbf").split()
  out = []
  for line in lines[2:]:
    cells = line.replace("|", " ").split()
    assert len(cells) == len(head), (head, cells)
    out.append(dict(zip(head, cells)))
  return out


def _row(**kw):
  base = dict(m=4, k=256, n=128, fmt="int4", times_us={"xla": 20.0, "interpret": 50.0},
              bf16_us=40.0, floor_us=10.0, floor_bytes=10_000, source="trace",
              default_impl="xla", read_us=12.5)
  base.update(kw)
  return bench.Row(**base)


def test_derived_columns_are_floor_over_time_and_bf16_over_time():
  cells = _cells(bench.format_table([_row()], ["xla", "interpret"]))[0]
  assert cells["xla%fl"] == "50%" and cells["interp%fl"] == "20%"  # 10 / 20, 10 / 50
  assert cells["xla_xbf"] == "2.00x" and cells["interp_xbf"] == "0.80x"  # 40 / 20, 40 / 50
  assert cells["ceil%"] == "80%" and cells["read"] == "12.5"  # 10 / 12.5


def test_zero_and_missing_times_are_nan_not_a_crash():
  """A zero read or bf16 time (below the clock's resolution) raised ZeroDivisionError in
  ceil% and the plot, and lost the whole run."""
  row = _row(times_us={"xla": 0.0, "interpret": float("nan")}, bf16_us=0.0, read_us=0.0)
  assert math.isnan(row.read_ceiling())
  assert math.isnan(row.fraction_of_floor("xla")) and math.isnan(row.speedup("xla"))
  assert math.isnan(row.fraction_of_floor("interpret"))
  assert math.isnan(row.fraction_of_floor("pallas"))  # not timed at all
  cells = _cells(bench.format_table([row], ["xla", "interpret"]))[0]
  assert cells["ceil%"] == "nan%" and cells["xla%fl"] == "nan%"
  moe = bench.MoERow(tokens=1, experts=4, k=256, n=256, top_k=2,
                     times_us={i: 0.0 for i in bench.MOE_IMPLS}, floor_us=1.0,
                     floor_bytes=1.0, selected_experts=2.0, source="trace")
  assert bench.format_moe_table([moe]).splitlines()[2].split()[-1] == "nanx"


def test_plot_keeps_each_format_apart(tmp_path):
  """With two formats, each format's rows were drawn as one line per implementation in
  the same panel (points of both formats at each M, joined in a zigzag): now a row of
  panels per format, each line holding that format's rows only."""
  plt = pytest.importorskip("matplotlib.pyplot")
  rows = [_row(fmt=fmt, m=m, times_us={"xla": t}, floor_us=floor)
          for fmt, floor in (("int4", 10.0), ("mxfp4", 8.0))
          for m, t in ((1, 20.0), (16, 40.0))]
  bench.plot(rows, ["xla"], str(tmp_path / "p.png"), "title")
  fig = plt.gcf()
  assert (tmp_path / "p.png").stat().st_size > 0
  panels = {ax.get_title(): ax for ax in fig.axes}
  assert set(panels) == {"int4 K=256 N=128", "mxfp4 K=256 N=128"}
  for fmt, floor in (("int4", 10.0), ("mxfp4", 8.0)):
    lines = {ln.get_label(): ln for ln in panels[f"{fmt} K=256 N=128"].get_lines()}
    assert list(lines["xla"].get_xdata()) == [1, 16]
    assert list(lines["xla"].get_ydata()) == pytest.approx([5 * floor, 2.5 * floor])
    assert list(lines["bf16 jnp.dot"].get_ydata()) == pytest.approx([100 * floor / 40] * 2)


def test_nan_notes_come_from_the_reasons_not_from_splitting_notes():
  """A reason holding "; xla: " was split into two made-up notes."""
  why = "declines this shape; xla: would be used instead"
  row = _row(times_us={"xla": 20.0, "interpret": float("nan")},
             nan_reasons={"interpret": why})
  assert bench.nan_notes([row, _row(fmt="int4nk", **{
      "times_us": {"xla": 1.0, "interpret": float("nan")},
      "nan_reasons": {"interpret": why}})], ["xla", "interpret"]) == [
          f"nan: interpret int4,int4nk: {why}"]


@cpu_only
def test_failing_implementation_is_nan_with_its_reason_and_source_is_the_runs(monkeypatch):
  """int4nk has no interpret mode: its column is NaN in times_us (the key was missing
  from the JSON row) with the reason; ``source`` is the run's ("trace" was left where
  no implementation ran, on a CPU that times by wall clock)."""
  monkeypatch.setattr(bench, "_READ_US", {})
  row = bench.bench_shape(1, 256, 128, "int4nk", bandwidth=1e9, impls=["interpret"], calls=1)
  assert math.isnan(row.times_us["interpret"])
  assert "no interpret mode" in row.nan_reasons["interpret"]
  assert row.source == "wall" and row.bf16_us > 0


@cpu_only
def test_cpu_bench_json_table_and_plot_agree(tmp_path, capsys):
  """The CI-sized run with a second format whose interpret column is NaN: every row in
  the JSON and in the table, each cell the JSON's value rounded, the derived columns
  recomputed here from the JSON's raw times, the NaN's reason printed once, the plot
  written."""
  jpath, ppath = tmp_path / "b.json", tmp_path / "b.png"
  assert cli.main(["bench", "--calls", "2", "--m", "1,16", "--shapes", "256x384",
                   "--format", "int4,int4nk", "--json", str(jpath), "--plot",
                   str(ppath)]) == 0
  captured = capsys.readouterr()
  out = captured.out
  result = json.loads(jpath.read_text())
  rows = result["rows"]
  assert [(r["fmt"], r["m"], r["k"], r["n"]) for r in rows] == [
      (f, m, 256, 384) for f in ("int4", "int4nk") for m in (1, 16)]
  table = out[out.rindex("   fmt"):]
  cells = _cells("\n".join(table.splitlines()[:2 + len(rows)]))
  assert len(cells) == len(rows)
  # stdout holds each row once (the table); the rows as measured went to stderr
  row_lines = table.splitlines()[2:2 + len(rows)]
  err_rows = [" ".join(line.split()) for line in captured.err.splitlines()]
  for line in row_lines:
    assert out.count(line) == 1 and " ".join(line.split()) in err_rows
  for r, c in zip(rows, cells):
    t = r["times_us"]
    assert (c["fmt"], int(c["M"])) == (r["fmt"], r["m"])
    assert float(c["xla"]) == pytest.approx(t["xla"], abs=0.051)
    assert float(c["bf16"]) == pytest.approx(r["bf16_us"], abs=0.051)
    assert float(c["floor"]) == pytest.approx(r["floor_us"], abs=0.051)
    assert r["floor_us"] == pytest.approx(r["floor_bytes"] / result["bandwidth_bytes_per_s"]
                                          * 1e6)
    assert float(c["read"]) == pytest.approx(r["read_us"], abs=0.051)
    assert float(c["ceil%"][:-1]) == pytest.approx(100 * r["floor_us"] / r["read_us"],
                                                   abs=0.51)
    assert float(c["xla%fl"][:-1]) == pytest.approx(100 * r["floor_us"] / t["xla"], abs=0.51)
    assert float(c["xla_xbf"][:-1]) == pytest.approx(r["bf16_us"] / t["xla"], abs=0.0051)
    if r["fmt"] == "int4nk":
      assert math.isnan(t["interpret"]) and c["interpret"] == "nan"
      assert c["interp%fl"] == "nan%" and c["interp_xbf"] == "nanx"
      assert "no interpret mode" in r["nan_reasons"]["interpret"]
    else:
      assert t["interpret"] > 0 and r["nan_reasons"] == {}
      assert float(c["interpret"]) == pytest.approx(t["interpret"], abs=0.051)
      assert float(c["interp%fl"][:-1]) == pytest.approx(
          100 * r["floor_us"] / t["interpret"], abs=0.51)
      assert float(c["interp_xbf"][:-1]) == pytest.approx(r["bf16_us"] / t["interpret"],
                                                          abs=0.0051)
  notes = [line for line in out.splitlines() if line.startswith("nan: ")]
  reason = rows[2]["nan_reasons"]["interpret"]  # the API's words; the CLI names --impl
  assert "implementation='xla'" in reason
  cli_reason = reason.replace("implementation='xla'", "--impl xla")
  assert notes == [f"nan: interpret int4nk: {cli_reason}"]
  assert ppath.stat().st_size > 0 and f"plot written to {ppath}" in out


# ---------------------------------------------------------------- --tune's formats


def test_tune_refuses_untunable_formats_before_any_work(capsys, monkeypatch):
  """On a GPU, --tune --format int4,codebook tuned int4 for minutes, then stopped at
  codebook with a ValueError traceback."""
  monkeypatch.setattr(cli, "_on_gpu", lambda: True)
  monkeypatch.setattr(bench, "run", lambda args: pytest.fail("bench ran"))
  last = _usage_error(capsys, ["bench", "--tune", "--format", "int4,codebook,codebook2"])
  assert last.endswith("--tune --format int4,codebook,codebook2: codebook,codebook2 have "
                       "no kernel configs to sweep; tune int4,int4nk,mxfp4,mxfp4nk,nvfp4,"
                       "nvfp4nk")


def test_tunable_formats_are_the_ones_with_candidate_configs():
  import importlib  # pylint: disable=g-import-not-at-top
  importlib.import_module("pallas_kernels")  # registers the kernels
  from qjax._src import dispatch, tuning  # pylint: disable=g-import-not-at-top
  tunable = [f for f in bench.BENCH_FORMATS
             if dispatch.kernels_for(bench.random_weight(f, 256, 128, jax.random.key(0)))[0]
             .candidate_configs is not None]
  assert tuple(tunable) == bench.TUNABLE_FORMATS
  assert set(tunable) <= set(tuning.FORMATS)  # what the tuner writes, the lookup reads
