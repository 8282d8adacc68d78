"""Session 47: is `qjax generate` on a GPTQ checkpoint with zero points slower than on a
symmetric one (session 45 read 928 against 1090 tokens/s, one run each)?

Writes a Llama-3.2-1B-shaped GPTQ checkpoint of each kind once with
``examples/hf_generate_bench.py``'s writers, then runs ``qjax generate --implementation
auto`` (96 tokens) on them alternately, one process each, so that a first-run effect
shows. Run on a GPU from the repository root:

  python docs/experiments/s47_zero_points_generate.py
"""

import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import hf_generate_bench as hb  # noqa: E402  pylint: disable=wrong-import-position


def main():
  cfg = hb._config(False)  # pylint: disable=protected-access
  with tempfile.TemporaryDirectory() as tmp:
    for zero_points in (True, False):
      folder = pathlib.Path(tmp) / ("asym" if zero_points else "sym")
      hb.write_gptq(folder, cfg, zero_points)
      hb.write_tokenizer(folder, cfg.vocab_size)
    for name in ("asym", "sym", "asym", "sym"):
      t0 = time.time()
      rate, _ = hb.generate(pathlib.Path(tmp) / name, "auto", 96)
      print(name, rate, f"[{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
  main()
