"""A seeded mutation fuzzer for qjax's file readers (GGUF and safetensors).

Each case takes a small valid file (written here with the ``gguf`` package, ``qjax.save``
and ``safetensors``), applies one to three mutations (bit flips, interesting integers
written over 4- or 8-byte fields, truncation, deletion, duplication, splices with
another valid file, edits of a GGUF header's counts, lengths, types, dims and offsets,
JSON edits of a safetensors header), writes it, and runs every
reader of that kind on it. A reader may return or raise ``ValueError``; anything else
(another exception type, a case running past its time limit) is a failure, kept with the
bytes that caused it so it reproduces.

Run by ``qjax fuzz-readers`` (10,000 files per reader is the documented long run) and,
with a few hundred cases, by ``tests/test_hostile_files.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import resource
import signal
import tempfile
import time
import traceback
from typing import Callable

import numpy as np

INTERESTING_INTS = (0, 1, 2, 7, 32, 255, 256, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1,
                    2**32, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
READER_KINDS = ("gguf", "safetensors")


class CaseTimeout(BaseException):
  """Raised inside a case that runs past its time limit (a BaseException so no reader's
  ``except Exception`` swallows it)."""


# ------------------------------------------------------------------------------- seeds


def _gguf_seed(path: pathlib.Path, variant: int) -> None:
  import gguf  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(variant)
  qt = gguf.GGMLQuantizationType
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_string("tokenizer.ggml.model", "gpt2")
  writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
  writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 0.25])
  writer.add_uint32("llama.block_count", 1)
  writer.add_float32("llama.rope.freq_base", 10000.0)
  writer.add_bool("tokenizer.ggml.add_bos_token", True)
  blocks = {"Q4_0": (32, 18), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
  types = ("Q4_0", "Q8_0") if variant == 0 else ("Q4_K", "Q6_K")
  for t in types:
    block, nbytes = blocks[t]
    raw = rng.integers(0, 256, (2, nbytes), dtype=np.uint8)
    raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
    writer.add_tensor(f"{t.lower()}.weight", raw, raw_dtype=qt[t])
  writer.add_tensor("norm.weight", rng.standard_normal(16).astype(np.float32))
  writer.add_tensor("f16.weight", rng.standard_normal((2, 8)).astype(np.float16))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _safetensors_seed(path: pathlib.Path, variant: int) -> None:
  import qjax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(variant)
  if variant == 0:
    w = rng.standard_normal((64, 8)).astype(np.float32)
    qjax.save(path, {"layer/kernel": qjax.quantize(w, group_size=32, symmetric=False),
                     "layer/bias": np.arange(8, dtype=np.float32)})
  elif variant == 1:
    w = rng.standard_normal((32, 8)).astype(np.float32)
    qjax.save(path, {"fp4": qjax.quantize_nvfp4(w), "mx": qjax.quantize_mxfp4(w)})
  else:  # a plain (non-qjax) safetensors file, as a Hugging Face checkpoint holds
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    save_file({"model.embed.weight": rng.standard_normal((4, 8)).astype(np.float16),
               "model.layers.0.qweight": rng.integers(0, 2**31, (2, 8), dtype=np.int32)},
              str(path), metadata={"format": "pt"})


def seed_files(kind: str, folder: pathlib.Path) -> list[bytes]:
  """Valid small files of a reader kind, as bytes."""
  folder.mkdir(parents=True, exist_ok=True)
  out = []
  variants = {"gguf": (_gguf_seed, 2), "safetensors": (_safetensors_seed, 3)}
  write, count = variants[kind]
  for v in range(count):
    path = folder / f"seed{v}.{kind}"
    write(path, v)
    out.append(path.read_bytes())
  return out


# --------------------------------------------------------------------------- mutations


def _position(rng: np.random.Generator, n: int) -> int:
  """A byte position, half the time within the first 512 bytes (where headers are)."""
  if n <= 1:
    return 0
  if rng.random() < 0.5:
    return int(rng.integers(0, min(n, 512)))
  return int(rng.integers(0, n))


def _edit_json_header(rng: np.random.Generator, data: bytes) -> bytes:
  """Rewrites one value of a safetensors JSON header (and fixes the header length)."""
  n = int.from_bytes(data[:8], "little")
  try:
    header = json.loads(data[8:8 + n])
  except ValueError:
    return data
  if not isinstance(header, dict):
    return data
  names = [k for k in header if k != "__metadata__"]
  if not names:
    return data
  try:
    _edit_entry(rng, header, header[names[int(rng.integers(len(names)))]])
  except (KeyError, TypeError, IndexError, ValueError, AttributeError):
    return data  # an earlier mutation already broke this entry's structure
  text = json.dumps(header).encode()
  return len(text).to_bytes(8, "little") + text + data[8 + n:]


def _edit_entry(rng: np.random.Generator, header: dict, entry: dict) -> None:
  choice = int(rng.integers(6))
  big = int(rng.choice(INTERESTING_INTS))
  if choice == 0:
    entry["data_offsets"] = [int(rng.integers(0, 64)), big]
  elif choice == 1:
    entry["data_offsets"] = [0, int(entry["data_offsets"][1])]  # overlaps the first
  elif choice == 2:
    entry["shape"] = [big, *entry["shape"][1:]]
  elif choice == 3:
    entry["dtype"] = str(rng.choice(["Q4", "F8_E4M3", "I8", "", "C64", "F4"]))
  elif choice == 4:
    entry["shape"] = [-1] if rng.random() < 0.5 else [2] * 40
  else:
    meta = header.get("__metadata__") or {}
    if "qjax" in meta:
      desc = meta["qjax"]
      i = int(rng.integers(0, max(len(desc), 1)))
      meta["qjax"] = desc[:i] + str(rng.choice(["9", "-1", "null", "[]", "{}", '"x"'])) + \
          desc[i + 1:]


def _edit_gguf_integer(rng: np.random.Generator, b: bytearray) -> None:
  """Overwrites one header integer of a GGUF file (a count, length, value type, dim,
  GGML type or offset) with an interesting value or a near neighbour of its own."""
  from qjax._src import gguf_header  # pylint: disable=g-import-not-at-top
  try:
    fields = gguf_header.integer_fields(bytes(b))
  except ValueError:  # already mutated into an invalid file: nothing to aim at
    return
  if not fields:
    return
  pos, size = fields[int(rng.integers(len(fields)))]
  old = int.from_bytes(b[pos:pos + size], "little")
  if rng.random() < 0.5:
    new = int(rng.choice(INTERESTING_INTS))
  else:
    new = old + int(rng.choice([-2, -1, 1, 2, 32, -32]))
  b[pos:pos + size] = (new % (1 << (8 * size))).to_bytes(size, "little")


def mutate(rng: np.random.Generator, data: bytes, others: list[bytes], kind: str) -> bytes:
  """One to three random mutations of ``data``."""
  b = bytearray(data)
  for _ in range(int(rng.integers(1, 4))):
    op = int(rng.integers(9))
    if op == 8 and kind == "gguf":
      _edit_gguf_integer(rng, b)
      continue
    n = len(b)
    if op == 0 and n:  # bit flips
      for _ in range(int(rng.integers(1, 5))):
        i = _position(rng, n)
        b[i] ^= 1 << int(rng.integers(8))
    elif op == 1 and n:  # interesting byte
      b[_position(rng, n)] = int(rng.choice([0, 1, 0x7F, 0x80, 0xFF]))
    elif op == 2 and n >= 8:  # interesting integer over a 4- or 8-byte field
      width = 8 if rng.random() < 0.6 else 4
      i = min(_position(rng, n), n - width)
      v = int(rng.choice(INTERESTING_INTS)) % (1 << (8 * width))
      b[i:i + width] = v.to_bytes(width, "little")
    elif op == 3:  # truncation
      b = b[:int(rng.integers(0, n + 1))]
    elif op == 4 and n:  # deletion
      i = _position(rng, n)
      del b[i:i + int(rng.integers(1, 64))]
    elif op == 5 and n:  # duplication
      i = _position(rng, n)
      b[i:i] = b[i:i + int(rng.integers(1, 64))]
    elif op == 6 and others:  # splice with another valid file
      other = others[int(rng.integers(len(others)))]
      b = b[:int(rng.integers(0, n + 1))] + other[int(rng.integers(0, len(other) + 1)):]
    elif op == 7:  # appended garbage
      b += rng.integers(0, 256, int(rng.integers(1, 256)), dtype=np.uint8).tobytes()
    elif op == 8 and kind == "safetensors":
      b = bytearray(_edit_json_header(rng, bytes(b)))
  return bytes(b)


# ----------------------------------------------------------------------------- readers


def _read_gguf(path: str) -> None:
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
  gguf_io.describe_gguf(path)
  gguf_io.read_metadata(path)
  gguf_io.load_gguf(path, progress=False)


def _read_qjax(path: str) -> None:
  from qjax._src import serialization  # pylint: disable=g-import-not-at-top
  serialization.load(path)


def _read_checkpoint(path: str) -> None:
  from qjax._src import safetensors_io  # pylint: disable=g-import-not-at-top
  ckpt = safetensors_io.Checkpoint(path)
  for name in ckpt.names():
    ckpt.shape(name)
    ckpt.get(name)


READERS: dict[str, tuple[Callable[[str], None], ...]] = {
    "gguf": (_read_gguf,),
    "safetensors": (_read_qjax, _read_checkpoint),
}


# --------------------------------------------------------------------------------- run


@dataclasses.dataclass
class FuzzReport:
  """What a fuzz run saw, per reader kind."""
  kind: str
  cases: int = 0
  accepted: int = 0           # every reader returned
  rejected: int = 0           # some reader raised ValueError (and none failed)
  failures: list[dict] = dataclasses.field(default_factory=list)  # other exceptions
  hangs: int = 0
  seconds: float = 0.0         # the mutated cases (after the seed files and warm-up)
  setup_seconds: float = 0.0   # writing the seed files and reading each once (imports)
  slowest_case_s: float = 0.0  # of the mutated cases
  peak_rss_mib: float = 0.0
  rss_growth_mib: float = 0.0  # peak RSS minus RSS after the seed files were read

  @property
  def ok(self) -> bool:
    return not self.failures and not self.hangs

  def summary(self) -> str:
    return (f"{self.kind}: {self.cases} files, {self.accepted} read, {self.rejected} "
            f"rejected with ValueError, {len(self.failures) - self.hangs} crashes, "
            f"{self.hangs} hangs; {self.seconds:.1f} s for the cases (slowest "
            f"{self.slowest_case_s:.2f} s; {self.setup_seconds:.1f} s of setup), "
            f"peak RSS {self.peak_rss_mib:.0f} MiB "
            f"(+{self.rss_growth_mib:.0f} MiB over the baseline)")


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _on_alarm(signum, frame):
  raise CaseTimeout()


def run(kind: str, cases: int, *, seed: int = 0, case_timeout_s: float = 10.0,
        failures_dir: str | os.PathLike | None = None,
        progress: Callable[[int, FuzzReport], None] | None = None) -> FuzzReport:
  """Fuzzes the readers of ``kind`` ("gguf" or "safetensors") with ``cases`` files.

  Args:
    kind: which readers.
    cases: mutated files to try.
    seed: the run's seed; case ``i`` uses ``default_rng([seed, i])`` so one case
      reproduces alone.
    case_timeout_s: a case running longer is a hang (SIGALRM; main thread only).
    failures_dir: where to keep the bytes of failing cases (default: not kept).
    progress: called as ``progress(i, report)`` every 500 cases.
  """
  if kind not in READERS:
    raise ValueError(f"{kind=} must be one of {READER_KINDS}")
  report = FuzzReport(kind)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"qjax-fuzz-{kind}-") as tmp:
    tmp = pathlib.Path(tmp)
    seeds = seed_files(kind, tmp / "seeds")
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
      # Warm up (imports, jit caches) so the RSS baseline is honest. The seed files are
      # valid: a reader failing on one is reported like any other failure.
      warm = FuzzReport(kind)
      for j, data in enumerate(seeds):
        path = tmp / "warm"
        path.write_bytes(data)
        outcome = _run_case(kind, str(path), case_timeout_s, warm)
        if outcome is not None:
          report.failures.append({**outcome, "case": f"seed{j}"})
      report.hangs += warm.hangs
      baseline = _rss_mib()
      report.setup_seconds = time.perf_counter() - start
      start = time.perf_counter()
      for i in range(cases):
        rng = np.random.default_rng([seed, i])
        data = mutate(rng, seeds[int(rng.integers(len(seeds)))], seeds, kind)
        path = tmp / f"case.{kind}"
        path.write_bytes(data)
        outcome = _run_case(kind, str(path), case_timeout_s, report)
        if outcome is not None:
          outcome["case"] = i
          report.failures.append(outcome)
          if failures_dir is not None:
            out = pathlib.Path(failures_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{kind}-seed{seed}-case{i}.bin").write_bytes(data)
        report.cases += 1
        if progress is not None and (i + 1) % 500 == 0:
          progress(i + 1, report)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, previous)
  report.seconds = time.perf_counter() - start
  report.peak_rss_mib = _rss_mib()
  report.rss_growth_mib = report.peak_rss_mib - baseline
  return report


def _run_case(kind: str, path: str, timeout_s: float, report: FuzzReport) -> dict | None:
  """Runs every reader of ``kind`` on ``path``; a failure's description, or None."""
  t0 = time.perf_counter()
  rejected = False
  try:
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    for reader in READERS[kind]:
      try:
        reader(path)
      except ValueError:
        rejected = True
  except CaseTimeout:
    report.hangs += 1
    return {"reader": kind, "error": f"hang: over {timeout_s} s"}
  except (KeyboardInterrupt, SystemExit):
    raise
  except BaseException as e:  # pylint: disable=broad-except  (Rust panics included)
    return {"reader": kind, "error": f"{type(e).__name__}: {e}"[:500],
            "traceback": traceback.format_exc(limit=6)[-2000:]}
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    report.slowest_case_s = max(report.slowest_case_s, time.perf_counter() - t0)
  if rejected:
    report.rejected += 1
  else:
    report.accepted += 1
  return None
