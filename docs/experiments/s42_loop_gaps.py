"""Session 42: where the time of SmolLM2's 16-step decode loop goes on the device timeline.

  python docs/experiments/s42_loop_gaps.py [--slots N] [--calls N]

Traces ``--calls`` calls of the decode loop (as ``qjax generate`` runs it, see
s42_decode_write.py) under the JAX profiler and prints, per call: wall time, the span
from its first to its last device event, busy time (union of the events), the number of
kernels and of host <-> device copies, and the gaps between consecutive events by size
(with the events around the largest ones), to tell a device-bound loop from one that
waits on the host.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time

import jax

from qjax._src import devtime
from qjax._src import generate
from qjax._src import gguf_io

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import s42_decode_write  # pylint: disable=g-import-not-at-top,wrong-import-position


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--slots", type=int, default=512)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--variant", default="joined")
  args = parser.parse_args()
  gfile = gguf_io.load_gguf(gguf_io.read_header(generate.default_model_path()),
                            progress=False)
  call = s42_decode_write.variant(gfile, args.variant, args.slots)
  for _ in range(5):
    jax.device_get(call())
  walls = []
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(args.calls):
      t0 = time.perf_counter()
      jax.device_get(call())
      walls.append(time.perf_counter() - t0)
      time.sleep(0.02)  # a clear gap between calls on the timeline
    jax.profiler.stop_trace()
    trace = devtime._read_trace(d)  # pylint: disable=protected-access
  events = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
                   for e in devtime._stream_events(trace)),  # pylint: disable=protected-access
                  key=lambda e: e[0])
  # Split into calls at gaps of more than 5 ms.
  calls, cur = [], [events[0]]
  for e in events[1:]:
    if e[0] - cur[-1][1] > 5000:
      calls.append(cur)
      cur = []
    cur.append(e)
  calls.append(cur)
  print(f"{len(events)} device events, {len(calls)} calls; wall ms: "
        + ", ".join(f"{w * 1e3:.2f}" for w in walls))
  for i, evs in enumerate(calls):
    span = evs[-1][1] - evs[0][0]
    # pylint: disable=protected-access
    busy = devtime._busy_union([(a, b) for a, b, _ in evs])
    copies = sum(any(s in n.lower() for s in devtime._SKIP) for _, _, n in evs)
    gaps = [(evs[j + 1][0] - evs[j][1], j) for j in range(len(evs) - 1)]
    hist = collections.Counter(
        "<1" if g < 1 else "1-2" if g < 2 else "2-5" if g < 5 else "5-20" if g < 20
        else ">=20" for g, _ in gaps)
    total = {k: sum(g for g, _ in gaps if ("<1" if g < 1 else "1-2" if g < 2 else "2-5"
                                             if g < 5 else "5-20" if g < 20 else ">=20") == k)
             for k in hist}
    print(f"call {i}: span {span:.0f} us, busy {busy:.0f} us, {len(evs)} events "
          f"({copies} host copies); gaps us by size: "
          + ", ".join(f"{k}: {hist[k]}x {total[k]:.0f}" for k in ("<1", "1-2", "2-5", "5-20",
                                                                ">=20") if k in hist))
    if i == 0:
      for g, j in sorted(gaps, reverse=True)[:4]:
        print(f"   gap {g:7.1f} us after {evs[j][2][:60]!r} before {evs[j + 1][2][:60]!r}")
      pairs = collections.defaultdict(list)
      for g, j in gaps:
        if g >= 2:
          pairs[(evs[j][2][:34], evs[j + 1][2][:34])].append(g)
      print("   gaps of 2 us or more by the events around them (count, total us):")
      for (x, y), gs in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:14]:
        print(f"     {len(gs):4d}x {sum(gs):8.1f}  {x!r} -> {y!r}")
      names = collections.Counter(n for _, _, n in evs)
      print("   most frequent events:", ", ".join(f"{n[:40]} x{c}" for n, c in
                                                names.most_common(8)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
