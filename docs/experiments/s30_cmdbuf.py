"""Wall vs device time of the Llama-8B-shaped int4 stack, Int4Weight vs kernel_layouts
(Int4NKWeight), under several XLA command-buffer flags (each in a fresh process)."""
import json, os, subprocess, sys
size = dict(layers=32, hidden=4096, inter=14336, kv=1024, calls=50)
code = ("import json, sys\nfrom qjax._src import bench\n"
        "r = bench.llama_stack_tokens_per_s(**json.loads(sys.argv[1]))\n"
        "print('RESULT ' + json.dumps(r), flush=True)\n")
flag_sets = {
  "default": "",
  "no cmd buffers": "--xla_gpu_enable_command_buffer=",
  "cmd +CUSTOM_CALL": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
  "concurrent": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
}
for name, flags in flag_sets.items():
  for layouts in (False, True):
    for scanned in ((False, True) if name == "default" else (False,)):
      env = dict(os.environ, XLA_FLAGS=flags)
      p = subprocess.run([sys.executable, "-c", code, json.dumps(dict(size, layouts=layouts, scanned=scanned))],
                         env=env, capture_output=True, text=True, timeout=300)
      lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
      if not lines:
        print(name, layouts, "FAILED", p.stderr[-1500:], flush=True); continue
      r = json.loads(lines[-1][7:])
      print(f"{name:<18} {'NK' if layouts else 'Int4Weight':<10} {'scan' if scanned else 'unrolled':<8} "
            f"int4 {r['int4_tokens_per_s']:7.1f} tok/s (wall {1e3/r['int4_tokens_per_s']:.2f} ms, device {r['int4_device_ms']:.2f} ms)  "
            f"bf16 {r['bf16_tokens_per_s']:6.1f} tok/s", flush=True)
