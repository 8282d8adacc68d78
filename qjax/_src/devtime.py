"""Device time of jitted calls, read from a JAX profiler trace.

Wall time around a jitted call measures host dispatch; this measures what the device
spent: the calls run under ``jax.profiler`` tracing, and the durations of the kernels
of the device's (GPU) processes in the trace are summed and divided by the number of
calls. Argument sets rotate so that repeated calls do not read weights from L2: the timed
calls take the sets after the warm-up calls' (:func:`_timed_set`), so that a set the
warm-up has just read (and may have left in L2) comes last, if at all.

On the CPU there are no device kernel events; the fallback is the median wall time of
synchronous calls, and results say so (``source == "wall"``).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import jax

# Events that are transfers between host and device, not work of the call.
_SKIP = ("memcpyhtod", "memcpydtoh", "memcpy htod", "memcpy dtoh")


def _timed_set(arg_sets: Sequence[tuple], warmup: int, i: int) -> tuple:
  """The argument set of timed call ``i``: the rotation goes on from the warm-up's, so
  that with fewer timed calls than sets none repeats a set the warm-up read just before
  (until session 44 the timed calls started again at set 0: with 5 calls over 24 sets,
  3 of them found their 8 MB weight in the H200's L2, 1 us less at 4096x4096)."""
  return arg_sets[(warmup + i) % len(arg_sets)]


@dataclasses.dataclass(frozen=True)
class Timing:
  us: float  # per call
  source: str  # "trace" (device kernels) or "wall"
  kernels: tuple[str, ...] = ()  # distinct kernel names seen


def _device_pids(trace: dict[str, Any]) -> set[int]:
  pids = set()
  for e in trace.get("traceEvents", []):
    if e.get("ph") == "M" and e.get("name") == "process_name":
      name = str(e.get("args", {}).get("name", ""))
      if "GPU" in name or "/device:" in name and "CPU" not in name:
        pids.add(e["pid"])
  return pids


def _read_trace(log_dir: str) -> dict[str, Any]:
  files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    return {}
  with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
    return json.load(f)


def _stream_events(trace: dict[str, Any]) -> Iterator[dict[str, Any]]:
  """The complete ("X") events of the device's stream threads.

  A GPU process has per-stream threads holding the kernels and summary lines ("XLA Ops",
  "XLA Modules") that overlap them: only the stream threads count (all of the device's
  threads where none is named a stream).
  """
  pids = _device_pids(trace)
  events = trace.get("traceEvents", [])
  streams = {(e["pid"], e["tid"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in pids
             and "stream" in str(e.get("args", {}).get("name", "")).lower()}
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in pids:
      continue
    if streams and (e.get("pid"), e.get("tid")) not in streams:
      continue
    yield e


def device_time(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, calls: int = 40,
                warmup: int = 3) -> Timing:
  """Per-call device time of ``fn(*args)`` over rotating ``arg_sets``."""
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  if jax.devices()[0].platform == "cpu":
    walls = []
    for i in range(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*_timed_set(arg_sets, warmup, i)))
      walls.append(time.perf_counter() - t0)
    return Timing(us=statistics.median(walls) * 1e6, source="wall")
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    try:
      outs = [fn(*_timed_set(arg_sets, warmup, i)) for i in range(calls)]
      jax.block_until_ready(outs)
    finally:
      jax.profiler.stop_trace()
    trace = _read_trace(d)
  total = 0.0
  names = set()
  for e in _stream_events(trace):
    name = str(e.get("name", ""))
    if any(s in name.lower() for s in _SKIP):
      continue
    total += float(e.get("dur", 0.0))
    names.add(name)
  if not names:
    raise RuntimeError(
        "the profiler trace holds no device kernel events: is this a GPU, and is no other "
        "process profiling it? (CUPTI failed to attach in pytest-xdist workers sharing one "
        "H100; time in one process)")
  return Timing(us=total / calls, source="trace", kernels=tuple(sorted(names)))


def _busy_union(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop <= end:
      continue
    total += stop - max(start, end)
    end = stop
  return total


def device_busy_time(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, calls: int = 10,
                     warmup: int = 2) -> Timing:
  """Per-call time during which the device did anything: the union over all GPU streams
  of kernel and host-device copy intervals (a copy that overlaps a kernel counts once).

  The measure for work that moves data between host and device (offloaded weights),
  where :func:`device_time` would drop the copies. Falls back to wall time on the CPU.
  """
  if jax.devices()[0].platform == "cpu":
    return device_time(fn, arg_sets, calls=calls, warmup=warmup)
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    try:
      for i in range(calls):  # one at a time: the union must not merge two calls' gaps
        jax.block_until_ready(fn(*_timed_set(arg_sets, warmup, i)))
    finally:
      jax.profiler.stop_trace()
    trace = _read_trace(d)
  intervals, names = [], set()
  for e in _stream_events(trace):
    start = float(e.get("ts", 0.0))
    intervals.append((start, start + float(e.get("dur", 0.0))))
    names.add(str(e.get("name", "")))
  if not intervals:
    raise RuntimeError("the profiler trace holds no device events; is this a GPU?")
  return Timing(us=_busy_union(intervals) / calls, source="trace-busy",
                kernels=tuple(sorted(names)))
