"""CLI audit: bad output paths and values that gave a traceback (after all the work) or a
wrong result are one usage line with exit code 2, before any work starts.

Each argv keeps the run small (one shape, one call, one format, one case), so that on
code without the check the command gets to the failing write quickly.
"""

import sys

import pytest

from conftest import cpu_only
from qjax._src import cli
from test_cli import _usage_error  # exit code 2, one "qjax CMD: error: " line

# A small run of each command that writes a file at the end (or after each format).
SMALL = {
    "bench": ["bench", "--calls", "1", "--m", "1", "--shapes", "256x128"],
    "check": ["check", "--formats", "int4-sym-g32", "--impl", "xla", "--quiet"],
    "fuzz-readers": ["fuzz-readers", "--reader", "gguf", "--cases", "1"],
}
OUTPUTS = [("bench", "--json", "r.json"), ("bench", "--plot", "p.png"),
           ("check", "--json", "c.json"), ("fuzz-readers", "--json", "f.json")]


@pytest.mark.parametrize("command,option,name", OUTPUTS,
                         ids=[f"{c} {o}" for c, o, _ in OUTPUTS])
def test_output_in_a_missing_folder_is_a_usage_error(capsys, tmp_path, command, option,
                                                     name):
  """Was a FileNotFoundError traceback after the whole run (check: after its first
  format), the results lost."""
  path = tmp_path / "missing" / name
  last = _usage_error(capsys, SMALL[command] + [option, str(path)])
  assert f"argument {option}: {str(path)!r}: the folder" in last
  assert "does not exist; create it first" in last
  assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command,option,name", OUTPUTS,
                         ids=[f"{c} {o}" for c, o, _ in OUTPUTS])
def test_output_under_a_file_names_the_file(capsys, tmp_path, command, option, name):
  """A file where the path needs a folder was called a missing folder."""
  (tmp_path / "t.txt").write_text("x")
  path = tmp_path / "t.txt" / "sub" / name
  last = _usage_error(capsys, SMALL[command] + [option, str(path)])
  assert (f"argument {option}: {str(path)!r}: {str(tmp_path / 't.txt')!r} is a file, not a "
          "folder; give a path in a folder") in last


@pytest.mark.parametrize("command,option,name", OUTPUTS,
                         ids=[f"{c} {o}" for c, o, _ in OUTPUTS])
def test_output_that_is_a_folder_is_a_usage_error(capsys, tmp_path, command, option, name):
  """Was an IsADirectoryError traceback after the whole run."""
  last = _usage_error(capsys, SMALL[command] + [option, str(tmp_path)])
  assert f"argument {option}: {str(tmp_path)!r} is a folder; give a file name in it" in last


@pytest.mark.parametrize("name,message", [
    ("plot", "has no extension (matplotlib would write"),
    ("plot.txt", "ends in .txt, not a plot format")])
def test_plot_name_needs_a_plot_extension(capsys, tmp_path, name, message):
  """Without an extension matplotlib wrote PLOT.png while bench printed "plot written to
  PLOT"; an unknown extension was a ValueError traceback after the whole run."""
  last = _usage_error(capsys, SMALL["bench"] + ["--plot", str(tmp_path / name)])
  assert message in last and ".png" in last and ".svg" in last
  assert not list(tmp_path.iterdir())


def test_plot_without_matplotlib_is_a_usage_error(capsys, tmp_path, monkeypatch):
  """matplotlib is an optional extra (qjax[plot]): its absence was an ImportError traceback
  after the whole run."""
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec answers None
  last = _usage_error(capsys, SMALL["bench"] + ["--plot", str(tmp_path / "p.png")])
  assert "argument --plot: the plot needs matplotlib: pip install 'qjax[plot]'" in last


def test_plot_name_with_a_plot_extension_is_accepted(tmp_path):
  args = cli.build_parser().parse_args(["bench", "--plot", str(tmp_path / "p.SVG")])
  assert args.plot == str(tmp_path / "p.SVG")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "ten"])
def test_fuzz_timeout_must_be_seconds_above_zero(capsys, value):
  """-1 and nan made every case a failure (itimer_error / ValueError, exit 1); 0 turned the
  hang detection off (setitimer(0) disarms the timer) and passed."""
  last = _usage_error(capsys, SMALL["fuzz-readers"] + ["--timeout", value])
  assert f"argument --timeout: {value!r} is not a number of seconds above 0" in last


def test_fuzz_keep_failures_that_is_a_file_is_a_usage_error(capsys, tmp_path):
  """Was a FileExistsError traceback at the first failing case."""
  path = tmp_path / "a-file"
  path.write_text("x")
  last = _usage_error(capsys, SMALL["fuzz-readers"] + ["--keep-failures", str(path)])
  assert f"argument --keep-failures: {str(path)!r} is a file, not a folder" in last


@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_gguf_path_that_is_a_folder_says_so(capsys, tmp_path, command):
  """A folder was reported as "no such GGUF file: DIR", though DIR exists."""
  (tmp_path / "model.gguf").write_bytes(b"")
  argv = [command, str(tmp_path)] if command == "inspect" else [
      command, "--model", str(tmp_path), "--max-new-tokens", "1"]
  assert cli.main(argv) == 2
  captured = capsys.readouterr()
  assert not captured.out
  what = ("a folder without config.json (not a Hugging Face checkpoint)"
          if command == "generate" else "a folder")
  assert captured.err == (f"qjax {command}: error: {tmp_path} is {what}, not a GGUF file; "
                          f"give the .gguf file, e.g. {tmp_path / 'model.gguf'}\n")


@cpu_only
def test_generate_pallas_without_a_gpu_is_refused_before_loading(capsys, monkeypatch):
  """Was refused only after the whole model had loaded (at its first weight)."""
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  def load(*args, **kwargs):
    raise AssertionError("the model was loaded before the refusal")
  monkeypatch.setattr(gguf_io, "load_gguf", load)
  assert cli.main(["generate", "--implementation", "pallas", "--model", "any.gguf"]) == 2
  captured = capsys.readouterr()
  assert not captured.out
  assert captured.err.strip() == (
      "qjax generate: error: --implementation pallas needs a GPU (the compiled kernels); "
      "this device is cpu: use auto or xla, or interpret (the kernels' programs on the "
      "CPU, slowly)")


@cpu_only
def test_bench_moe_says_why_a_column_is_nan(capsys):
  """The wgmma column of ``qjax bench --moe`` is NaN off Hopper: one line says why (it was
  a bare nan column)."""
  assert cli.main(["bench", "--moe", "--calls", "1", "--m", "1", "--shapes", "128x256",
                   "--moe-experts", "4", "--moe-top-k", "2"]) == 0
  out = capsys.readouterr().out
  assert out.count("# nan wgmma: Hopper's wgmma MoE kernel does not run on") == 1, out
  assert "# nan default" not in out and "# nan xla" not in out
