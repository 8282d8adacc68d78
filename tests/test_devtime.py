"""qjax._src.devtime's reading of a profiler trace (synthetic traces; no GPU needed)."""

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
