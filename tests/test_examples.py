"""examples/*.py as a user runs them: ``--help`` everywhere, the CPU runs with tiny
arguments, one line and a non-zero exit where a GPU is needed, and every option heard."""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import pytest

from conftest import child_env

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
GPU_ONLY = ("moe_decode_configs.py", "read_ceiling.py", "wgmma_breakdown.py",
            "wgmma_profile.py")
on_cpu = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="checks a CPU run")


def _run(name: str, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
  env = child_env(JAX_PLATFORMS="cpu",
                  XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env,
                        capture_output=True, text=True, timeout=240, cwd=ROOT)


def _module(name: str):
  spec = importlib.util.spec_from_file_location(name.removesuffix(".py"),
                                                ROOT / "examples" / name)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_the_list_of_examples_is_complete():
  assert set(GPU_ONLY) < set(EXAMPLES) and len(EXAMPLES) == 9, EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_prints_usage_and_runs_nothing(name):
  """Before: quantize_dense.py had no parser; --help ran the whole example."""
  proc = _run(name, "--help")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("usage: "), proc.stdout
  assert "relative output error" not in proc.stdout and "Traceback" not in proc.stderr


@on_cpu
@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_examples_say_so_in_one_line(name):
  proc = _run(name)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert "GPU" in last and ("Hopper" in last or "H100" in last), last


@on_cpu
def test_wgmma_profile_refuses_the_cpu_before_reading_its_shape():
  """Before: a --shape without an x was a traceback on a machine it could not run on."""
  proc = _run("wgmma_profile.py", "--shape", "8192")
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
  assert "Hopper" in proc.stderr


def test_quantize_dense_runs_on_the_cpu():
  proc = _run("quantize_dense.py")
  assert proc.returncode == 0, proc.stderr
  assert "relative output error of the int4 MLP" in proc.stdout


def test_tp_llama_bench_tiny_keeps_the_options_given_beside_it():
  """Before: --tiny overwrote --layers, --group-size, --steps, ... without a word."""
  mod = _module("tp_llama_bench.py")
  args = mod.parse_args(["--tiny", "--layers", "3", "--group-size", "64", "--steps", "2",
                         "--hidden", "512"])
  assert (args.layers, args.group_size, args.steps, args.hidden) == (3, 64, 2, 512)
  assert (args.ffn, args.heads, args.tile_k) == (512, 8, 8)  # the tiny defaults
  tiny = mod.parse_args(["--tiny"])
  assert (tiny.layers, tiny.hidden, tiny.group_size, tiny.tile_k, tiny.steps) == (
      2, 256, 32, 8, 10)
  full = mod.parse_args([])
  assert (full.layers, full.hidden, full.group_size, full.steps) == (16, 4096, 128, 50)


def test_tp_llama_bench_refuses_more_devices_than_there_are():
  """Before: --devices 3 on 2 devices printed an empty table and exited 0."""
  proc = _run("tp_llama_bench.py", "--tiny", "--devices", "3", devices=2)
  assert proc.returncode != 0, proc.stdout
  assert "--devices 3" in proc.stderr and "2 device(s)" in proc.stderr, proc.stderr


def test_tp_llama_bench_compares_with_one_device():
  """Before: --devices 2 timed and compared 2 devices against themselves, the column
  still headed 'vs 1'."""
  proc = _run("tp_llama_bench.py", "--tiny", "--devices", "2", "--batch", "1", "--steps",
              "1", "--warmup", "1", devices=2)
  assert proc.returncode == 0, proc.stderr
  rows = [line.split() for line in proc.stdout.splitlines()
          if line and not line.startswith(("#", "devices"))]
  assert [r[:2] for r in rows] == [["1", "1"], ["2", "1"]], proc.stdout
  assert float(rows[1][-1]) < 1e-4  # the 2-device output matches one device's


def test_xla_fallback_bench_runs_tiny_on_the_cpu():
  proc = _run("xla_fallback_bench.py", "--tiny", "--shapes", "256x128", "--ms", "1",
              "--calls", "1", "--variants", "materialize")
  assert proc.returncode == 0, proc.stderr
  assert "materialize" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("option", [["--shapes", "256"], ["--shapes", "100x64"],
                                    ["--shapes", "256x0"], ["--ms", "0"], ["--ms", "1,a"]])
def test_xla_fallback_bench_bad_shapes_and_ms_are_one_line(option):
  """Before: each was a traceback (or a table of nan with --ms 0)."""
  mod = _module("xla_fallback_bench.py")
  with pytest.raises(SystemExit) as e:
    mod.parse_args(["--tiny", *option])
  assert e.value.code == 2


@pytest.mark.parametrize("zero_points", [False, True])
def test_hf_generate_bench_runs_tiny_on_the_cpu(tmp_path, zero_points):
  """Both folders written and generated from, one row per run, the folders kept in --out;
  with --zero-points the GPTQ folder holds asymmetric codes (zero points other than 8)."""
  proc = _run("hf_generate_bench.py", "--tiny", "--tokens", "2", "--implementations", "xla",
              "--out", str(tmp_path), *(["--zero-points"] if zero_points else []))
  assert proc.returncode == 0, proc.stderr
  gptq = "gptq-asym" if zero_points else "gptq"
  rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {gptq} ")
          or line.startswith("| float16")]
  assert [r.split(" | ")[:2] for r in rows] == [[f"| {gptq}", "xla"], ["| float16", "xla"]]
  assert all("generated 2 tokens" in r and "device memory" in r for r in rows), rows
  assert (tmp_path / gptq / "config.json").exists()
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  params = hf_checkpoint.load_hf_llama(tmp_path / gptq, progress=False)[1]["params"]
  w = params["blocks"]["attn"]["q"]["kernel"]  # a GPTQWeight stack
  assert w.symmetric == (not zero_points)
  assert (tmp_path / "float16" / "tokenizer.json").exists()


def test_hf_generate_bench_options():
  mod = _module("hf_generate_bench.py")
  assert (mod.parse_args([]).tokens, mod.parse_args(["--tiny"]).tokens) == (96, 8)
  with pytest.raises(SystemExit) as e:
    mod.parse_args(["--tokens", "0"])
  assert e.value.code == 2


@pytest.mark.parametrize("arch,kind", [("qwen3moe", "Q4_K"), ("gpt-oss", "MXFP4")])
def test_moe_decode_bench_runs_tiny_on_the_cpu(arch, kind):
  """One row per (type, implementation) and the bf16 baseline, each with its rate."""
  proc = _run("moe_decode_bench.py", "--tiny", "--arch", arch, "--steps", "2", "--types",
              kind, "--implementations", "xla")
  assert proc.returncode == 0, proc.stderr
  rows = [line.split(" | ") for line in proc.stdout.splitlines()
          if line.startswith(f"| {kind}") or line.startswith("| BF16")]
  assert [r[:2] for r in rows] == [[f"| {kind}", "xla"], ["| BF16", "xla"]], proc.stdout
  assert float(rows[0][2]) > 0 and rows[1][3] == "1.00x", rows


def test_moe_decode_bench_int4_experts_on_the_cpu():
  """``--int4-experts``: the quantized model's experts are INT4 stacks (one row per
  implementation without kernels), the bf16 baseline as it is."""
  proc = _run("moe_decode_bench.py", "--tiny", "--steps", "2", "--types", "Q4_K",
              "--implementations", "xla", "--int4-experts")
  assert proc.returncode == 0, proc.stderr
  rows = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| Q4_K")]
  assert [r[:2] for r in rows] == [["| Q4_K, INT4 experts", "xla"]], proc.stdout
  assert float(rows[0][2]) > 0


def test_moe_decode_bench_options():
  mod = _module("moe_decode_bench.py")
  args = mod.parse_args([])
  assert (args.layers, args.steps, args.types) == (8, 64, ["Q4_0", "Q4_K", "MXFP4"])
  assert args.shape["experts"] == 128 and mod.parse_args(["--tiny"]).layers == 2
  gpt_oss = mod.parse_args(["--arch", "gpt-oss"])
  assert gpt_oss.types == ["MXFP4", "Q8_0"] and gpt_oss.shape["hidden"] == 2880
  for bad in (["--types", "Q4_0,Q3_K"], ["--steps", "0"], ["--layers", "-1"],
              ["--implementations", "triton"], ["--arch", "gpt-oss", "--types", "Q4_K"]):
    with pytest.raises(SystemExit) as e:
      mod.parse_args(bad)
    assert e.value.code == 2, bad
