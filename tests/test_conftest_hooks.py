"""The suite's own run controls (tests/conftest.py): ``QJAX_ONLY`` keeps the listed node
ids, ``QJAX_FAILS`` gets each failure's traceback as it happens, also under pytest-xdist
(written once, by the controlling process)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

_TESTS = '''
def test_fails():
  assert 1 == 2, "the reason"

def test_passes():
  pass

def test_also_fails():
  assert False, "not selected"
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_only_and_fails_files(tmp_path, workers):
  (tmp_path / "test_sample.py").write_text(_TESTS)
  only, fails = tmp_path / "only.txt", tmp_path / "fails.txt"
  only.write_text("test_sample.py::test_fails\ntest_sample.py::test_passes\n")
  env = child_env(QJAX_ONLY=str(only), QJAX_FAILS=str(fails), JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), env["PYTHONPATH"]])
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                         "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path),
                         *workers, str(tmp_path / "test_sample.py")],
                        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
  # (pytest-xdist's workers deselect; its controller does not count them.)
  assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
  assert "not selected" not in proc.stdout
  text = fails.read_text()
  assert text.count("==== test_sample.py::test_fails (call)") == 1, text
  assert "the reason" in text and "not selected" not in text
