"""The command line: --help texts, the demo and the CPU bench smoke test."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from qjax._src import cli


def test_help_lists_commands(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  out = capsys.readouterr().out
  for command in ("demo", "bench", "generate", "inspect", "check", "fuzz-readers"):
    assert command in out


def test_demo_reports_backend_and_error(capsys):
  assert cli.main(["demo", "--k", "256", "--n", "128", "--m", "4"]) == 0
  out = capsys.readouterr().out
  assert "backend that ran:  xla" in out
  err = float(out.split("output error:")[1].split()[0])
  assert err < 1e-2


def test_bench_on_cpu_is_labelled(tmp_path, capsys):
  path = tmp_path / "b.json"
  assert cli.main(["bench", "--calls", "2", "--m", "1,3", "--shapes", "256x128",
                   "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "CPU run" in out and "interpret" in out
  rows = json.loads(path.read_text())["rows"]
  assert [(r["m"], r["k"], r["n"]) for r in rows] == [(1, 256, 128), (3, 256, 128)]
  assert all(r["times_us"]["xla"] > 0 and r["times_us"]["interpret"] > 0 for r in rows)


def test_example_runs():
  root = pathlib.Path(__file__).resolve().parent.parent
  env = dict(os.environ, PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, str(root / "examples" / "quantize_dense.py")],
                        capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 0, proc.stderr
  assert "relative output error" in proc.stdout
