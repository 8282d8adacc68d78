"""Saves that lose nothing: a save killed midway leaves the previous file intact.

``qjax.save`` writes a temporary file ``.NAME.<random>.tmp`` in the same folder, fsyncs
it and renames it over ``NAME``; a SIGKILL before the rename leaves ``NAME`` as it was
(the temporary file stays behind, named so it cannot be mistaken for the file).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import qjax

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The child saves ~256 MiB over and over until it is killed.
CHILD = """
import sys
import numpy as np
import qjax
big = np.arange(64 * 2**20, dtype=np.float32)
print("ready", flush=True)
while True:
  qjax.save(sys.argv[1], {"big": big, "tag": np.array([2.0], np.float32)})
"""


def _kill_during_write(path: pathlib.Path) -> subprocess.Popen:
  """Starts a child saving to ``path``; SIGKILLs it while a temporary file is being
  written (seen growing but not complete); returns the dead child."""
  env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         "JAX_PLATFORMS": "cpu"}
  child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    assert child.stdout.readline().strip() == b"ready", child.stderr.read().decode()[-2000:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      temps = list(path.parent.glob(f".{path.name}.*.tmp"))
      if temps and any(0 < _size(t) < 200 * 2**20 for t in temps):
        child.send_signal(signal.SIGKILL)
        break
      if child.poll() is not None:
        pytest.fail(f"the child exited: {child.stderr.read().decode()[-2000:]}")
      time.sleep(0.0005)
    else:
      pytest.fail("never saw the temporary file being written")
  finally:
    if child.poll() is None:
      child.kill()
    child.wait(timeout=60)
    child.stdout.close()
    child.stderr.close()
  assert child.returncode == -signal.SIGKILL
  return child


def _size(p: pathlib.Path) -> int:
  try:
    return p.stat().st_size
  except FileNotFoundError:
    return 0


def test_killed_save_leaves_previous_file_intact(tmp_path):
  path = tmp_path / "weights.safetensors"
  w = qjax.quantize(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
  qjax.save(path, {"w": w, "tag": np.array([1.0], np.float32)})
  before = path.read_bytes()

  _kill_during_write(path)

  assert path.read_bytes() == before, "the previous file changed"
  loaded = qjax.load(path)
  assert float(loaded["tag"][0]) == 1.0
  np.testing.assert_array_equal(np.asarray(loaded["w"].codes), np.asarray(w.codes))
  # Nothing else carries the final name; what is left is a clearly named temporary file.
  others = sorted(p.name for p in tmp_path.iterdir() if p != path)
  assert all(re.fullmatch(r"\.weights\.safetensors\..+\.tmp", name) for name in others), others


def test_killed_first_save_leaves_no_file(tmp_path):
  path = tmp_path / "new.safetensors"
  _kill_during_write(path)
  assert not path.exists()


def test_save_is_a_rename_of_a_synced_temporary_file(tmp_path, monkeypatch):
  """The sequence save relies on: write, fsync the file, rename, fsync the folder."""
  calls = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
  monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", pathlib.Path(
      a).name, pathlib.Path(b).name)), real_replace(a, b))[1])
  path = tmp_path / "w.safetensors"
  qjax.save(path, {"a": np.ones(4, np.float32)})
  assert calls[0] == "fsync" and calls[-1] == "fsync"
  _, src, dst = calls[1]
  assert re.fullmatch(r"\.w\.safetensors\..+\.tmp", src) and dst == "w.safetensors"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_failed_save_removes_its_temporary_file(tmp_path, monkeypatch):
  path = tmp_path / "w.safetensors"
  qjax.save(path, {"a": np.ones(4, np.float32)})

  def fail(fd):
    raise OSError("disk full")
  monkeypatch.setattr(os, "fsync", fail)
  with pytest.raises(OSError, match="disk full"):
    qjax.save(path, {"a": np.zeros(4, np.float32)})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
  np.testing.assert_array_equal(qjax.load(path)["a"], np.ones(4, np.float32))


def test_load_checks_the_digest_and_sizes(tmp_path):
  path = tmp_path / "w.safetensors"
  qjax.save(path, {"a": np.arange(16, dtype=np.float32)})
  data = bytearray(path.read_bytes())
  data[-4] ^= 0x40
  path.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="sha256"):
    qjax.load(path)
  path.write_bytes(bytes(data[:-4]))
  with pytest.raises(ValueError, match="not a readable safetensors"):
    qjax.load(path)


def test_no_reader_unpickles():
  """No module of the three packages can unpickle (or eval) what it reads."""
  banned = re.compile(r"\bimport (c?pickle|dill|cloudpickle|marshal)\b|pickle\.loads?\(|"
                      r"allow_pickle\s*=\s*True|torch\.load\(|\beval\(|\bexec\(")
  offenders = []
  for package in ("qjax", "flax_layers", "pallas_kernels"):
    for py in (ROOT / package).rglob("*.py"):
      for i, line in enumerate(py.read_text().splitlines(), 1):
        if banned.search(line):
          offenders.append(f"{py.relative_to(ROOT)}:{i}: {line.strip()}")
  assert not offenders, offenders
