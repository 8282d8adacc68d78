"""Saves that lose nothing: a save killed midway leaves the previous file intact.

``qjax.save`` writes a temporary file ``.NAME.<random>.tmp`` in the same folder, fsyncs
it and renames it over ``NAME``; a SIGKILL before the rename leaves ``NAME`` as it was
(the temporary file stays behind, named so it cannot be mistaken for the file). Names
that would overwrite each other in the file, and what is not a flat mapping of names to
weights or arrays, are refused before anything is written.
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
from conftest import child_env

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
  env = child_env(JAX_PLATFORMS="cpu")
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


def test_names_that_collide_are_refused(tmp_path):
  """A quantized weight ``w`` stores ``w.codes``, ``w.scales``, ...: a plain array under
  one of those names (either order) would overwrite it; save names both and writes
  nothing. Distinct names round-trip bit for bit."""
  rng = np.random.default_rng(0)
  w = qjax.quantize(rng.standard_normal((256, 128)).astype(np.float32), group_size=64)
  other = rng.standard_normal((4, 128)).astype(np.float32)
  path = tmp_path / "c.safetensors"
  for tensors in ({"w": w, "w.scales": other}, {"w.scales": other, "w": w}):
    with pytest.raises(ValueError, match=r"'w(\.scales)?' and 'w(\.scales)?' would both be "
                       r"stored as the tensor 'w\.scales'"):
      qjax.save(path, tensors)
    assert not path.exists()
  with pytest.raises(ValueError, match="'__metadata__' is the safetensors header's own key"):
    qjax.save(path, {"__metadata__": other})
  qjax.save(path, {"w": w, "w_scales": other})
  back = qjax.load(path)
  np.testing.assert_array_equal(back["w_scales"], other)
  for field in ("codes", "scales"):
    np.testing.assert_array_equal(np.asarray(getattr(back["w"], field)),
                                  np.asarray(getattr(w, field)))


@pytest.mark.parametrize("tensors, error, match", [
    ({"n": {"w": np.ones(2)}}, TypeError, r"'n' is a dict, not an array or a quantized weight; "
     r"save takes a flat mapping"),
    ({"a": None}, TypeError, r"'a' is a NoneType, not an array"),
    ({1: np.ones(2)}, TypeError, r"tensor names must be strings, got 1 \(int\)"),
    ([np.ones(2)], TypeError, r"save takes a flat mapping .*, got list"),
])
def test_what_is_not_a_flat_mapping_is_refused(tmp_path, tensors, error, match):
  with pytest.raises(error, match=match):
    qjax.save(tmp_path / "x.safetensors", tensors)
  assert not (tmp_path / "x.safetensors").exists()
