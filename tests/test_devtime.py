"""qjax._src.devtime's reading of a profiler trace (synthetic traces and a real CPU trace;
no GPU needed)."""

import gzip
import json
import os
import types

import numpy as np
import pytest

from qjax._src import devtime


def _trace(with_streams: bool):
  m = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind,
                                    "args": {"name": name}}
  x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                       "ts": ts, "dur": dur}
  events = [m(1, 0, "process_name", "/device:GPU:0"), m(2, 0, "process_name", "/host:CPU"),
            m(1, 7, "thread_name", "Stream #7" if with_streams else "t7"),
            m(1, 9, "thread_name", "XLA Ops"),
            x(1, 7, "kernel_a", 0.0, 5.0), x(1, 7, "kernel_b", 3.0, 4.0),
            x(1, 9, "summary", 0.0, 9.0), x(2, 0, "host_work", 0.0, 100.0)]
  return {"traceEvents": events}


def test_stream_events_keep_the_device_streams_only():
  names = [e["name"] for e in devtime._stream_events(_trace(with_streams=True))]
  assert names == ["kernel_a", "kernel_b"]


def test_stream_events_without_named_streams_keep_every_device_thread():
  names = [e["name"] for e in devtime._stream_events(_trace(with_streams=False))]
  assert names == ["kernel_a", "kernel_b", "summary"]


def test_busy_union_counts_overlap_once():
  assert devtime._busy_union([(0.0, 5.0), (3.0, 7.0), (10.0, 11.0)]) == 8.0


# ---------------------------------------------------------------- audit: real traces, the
# summed events, the rotation and failures


def _profile_cpu(log_dir):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda a: a * 2.0 + 1.0)
  a = jnp.ones((4096,), jnp.float32)
  f(a).block_until_ready()
  jax.profiler.start_trace(str(log_dir))
  try:
    for _ in range(3):
      f(a).block_until_ready()
  finally:
    jax.profiler.stop_trace()


def test_real_cpu_trace_is_read_and_holds_no_device_events(tmp_path):
  """A trace jax.profiler writes on this machine (plugins/profile/<run>/<host>
  .trace.json.gz) is found and read; on a CPU its only process is the host's, whose
  threads (the XLA CPU client's thunks included) are not device work: nothing is summed,
  which is why device_time times CPUs by wall clock."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.devices()[0].platform != "cpu":
    pytest.skip("checks the CPU's trace")
  _profile_cpu(tmp_path)
  trace = devtime._read_trace(str(tmp_path))
  events = trace["traceEvents"]
  names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
  assert names and all("CPU" in n and "GPU" not in n for n in names), names
  hlo = [e for e in events if e.get("ph") == "X" and "fusion" in e.get("name", "")]
  assert len([e for e in hlo if not e["name"].startswith("end:")]) == 3  # one per call
  assert all(isinstance(e["dur"], float) for e in hlo)  # sub-microsecond resolution
  assert devtime._device_pids(trace) == set()
  assert list(devtime._stream_events(trace)) == []


def test_trace_path_without_device_events_raises(monkeypatch):
  """Were the trace path taken where the trace holds no device kernels (as on a CPU), the
  time would be 0; it raises instead, so a bench cell is never a silent 0."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if jax.devices()[0].platform != "cpu":
    pytest.skip("checks the CPU's trace")
  gpu = types.SimpleNamespace(platform="gpu", device_kind="fake")
  monkeypatch.setattr(devtime.jax, "devices", lambda *a: [gpu])
  f = jax.jit(lambda a: a + 1.0)
  with pytest.raises(RuntimeError, match="the profiler trace holds no device kernel events"):
    devtime.device_time(f, [(jnp.ones((8,)),)], calls=2, warmup=1)


def _fake_profiler(monkeypatch, events):
  """jax.profiler's start/stop replaced: stop writes ``events`` as a trace file where
  jax.profiler puts one; the platform answers "gpu"."""
  state = {}

  def start(log_dir):
    state["dir"] = log_dir

  def stop():
    run = os.path.join(state["dir"], "plugins", "profile", "run1")
    os.makedirs(run)
    with gzip.open(os.path.join(run, "host.trace.json.gz"), "wt") as f:
      json.dump({"traceEvents": events}, f)

  monkeypatch.setattr(devtime.jax.profiler, "start_trace", start)
  monkeypatch.setattr(devtime.jax.profiler, "stop_trace", stop)
  gpu = types.SimpleNamespace(platform="gpu", device_kind="fake")
  monkeypatch.setattr(devtime.jax, "devices", lambda *a: [gpu])


def test_device_time_sums_the_stream_kernels_per_call(monkeypatch):
  """The per-call time is the sum over the GPU streams' kernel events (host-device copies,
  the "XLA Ops" summary thread and host events left out) over the number of calls; each
  call takes the next argument set (the rotation), the warm-up calls before the trace."""
  m = lambda pid, tid, kind, name: {"ph": "M", "pid": pid, "tid": tid, "name": kind,
                                    "args": {"name": name}}
  x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                   "ts": 0.0, "dur": dur}
  events = [m(1, 0, "process_name", "/device:GPU:0"), m(2, 0, "process_name", "/host:CPU"),
            m(1, 7, "thread_name", "Stream #7(compute)"),
            m(1, 8, "thread_name", "Stream #8(MemcpyH2D)"),
            m(1, 9, "thread_name", "XLA Ops"),
            x(1, 7, "qjax_int4_matmul", 4.5), x(1, 7, "qjax_int4_matmul", 5.5),
            x(1, 7, "reduce_fusion", 1.25), x(1, 8, "MemcpyHtoD", 100.0),
            x(1, 7, "MemcpyDtoH", 50.0), x(1, 9, "qjax_int4_matmul", 11.0),
            x(2, 0, "PjitFunction", 500.0)]
  _fake_profiler(monkeypatch, events)
  seen = []

  def fn(a):
    seen.append(a)
    return np.zeros(1)

  t = devtime.device_time(fn, [(0,), (1,), (2,), (3,)], calls=2, warmup=2)
  assert t.us == pytest.approx((4.5 + 5.5 + 1.25) / 2)
  assert t.source == "trace" and t.kernels == ("qjax_int4_matmul", "reduce_fusion")
  # Warm-up 0, 1; the timed calls go on with 2, 3, not back to the sets the warm-up just
  # read (which may sit in L2).
  assert seen == [0, 1, 2, 3]
  seen.clear()
  devtime.device_time(fn, [(0,), (1,), (2,)], calls=4, warmup=2)
  assert seen == [0, 1, 2, 0, 1, 2]
  seen.clear()
  devtime.device_busy_time(fn, [(0,), (1,), (2,)], calls=2, warmup=1)
  assert seen == [0, 1, 2]
