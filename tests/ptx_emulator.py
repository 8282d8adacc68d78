"""A tiny emulator of the inline-PTX subset the kernels emit, for checking their logic on
the CPU (interpret mode runs the kernels' JAX formulas, never the PTX strings).

Values are numpy arrays: 32-bit registers as uint32, float registers as float64 (the
FMAs are then exact or nearly so, so results compare with a float64 formula). Covered:
``shl.b32``, ``shr.u32``, ``and.b32``, ``or.b32``, ``lop3.b32``, ``prmt.b32`` (default
mode), ``neg.f32``, ``mul.rn.f32``, ``fma.rn.f32``, ``mov.b32`` / ``mov.f32``; float
immediates ``0fXXXXXXXX``; ``.reg`` declarations and braces are skipped.
"""

import re

import numpy as np


def _bits_to_f64(u: np.ndarray) -> np.ndarray:
  return np.asarray(u, np.uint32).view(np.float32).astype(np.float64)


def _f64_to_bits(f: np.ndarray) -> np.ndarray:
  return np.asarray(f, np.float64).astype(np.float32).view(np.uint32)


def _lop3(a, b, c, lut):
  out = np.zeros_like(a)
  for bit in range(8):  # LUT index = (a << 2) | (b << 1) | c, per bit lane
    if lut >> bit & 1:
      ta = a if bit & 4 else ~a
      tb = b if bit & 2 else ~b
      tc = c if bit & 1 else ~c
      out |= ta & tb & tc
  return out


def _prmt(a, b, selector):
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  out = np.zeros_like(a)
  for i in range(4):
    nib = (selector >> (4 * i)) & 0xF
    assert nib < 8, "sign-replicate selectors are not emulated"
    out |= pool[nib] << (8 * i)
  return out


def run(ptx: str, operands: dict[str, np.ndarray], shape) -> dict[str, np.ndarray]:
  """Runs ``ptx`` with ``operands`` (``{"$1": array, ...}``: uint32 arrays for ``r``
  operands, float arrays for ``f`` ones) and returns the register file (``"$0"`` is the
  result: uint32 for integer ops, float64 for float ops)."""
  regs = {k: (np.asarray(v, np.uint32) if np.asarray(v).dtype == np.uint32
              else np.asarray(v, np.float64)) for k, v in operands.items()}

  def ival(tok):
    if tok in regs:
      v = regs[tok]
      return v if v.dtype == np.uint32 else _f64_to_bits(v)
    return np.full(shape, int(tok, 0), np.uint32)

  def fval(tok):
    if tok in regs:
      v = regs[tok]
      return v if v.dtype == np.float64 else _bits_to_f64(v)
    if tok.startswith("0f"):
      return np.full(shape, _bits_to_f64(np.uint32(int(tok[2:], 16))), np.float64)
    return np.full(shape, float(tok), np.float64)

  for line in ptx.splitlines():
    line = line.strip()
    if line in ("{", "}") or line.startswith(".reg"):
      continue
    m = re.fullmatch(r"([a-z0-9.]+)\s+(.*);", line)
    assert m, f"cannot parse PTX line {line!r}"
    op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
    d = args[0]
    if op == "shl.b32":
      regs[d] = ival(args[1]) << np.uint32(int(args[2]))
    elif op == "shr.u32":
      regs[d] = ival(args[1]) >> np.uint32(int(args[2]))
    elif op == "and.b32":
      regs[d] = ival(args[1]) & ival(args[2])
    elif op == "or.b32":
      regs[d] = ival(args[1]) | ival(args[2])
    elif op == "lop3.b32":
      regs[d] = _lop3(ival(args[1]), ival(args[2]), ival(args[3]), int(args[4], 0))
    elif op == "prmt.b32":
      regs[d] = _prmt(ival(args[1]), ival(args[2]), int(args[3], 0))
    elif op == "neg.f32":
      regs[d] = -fval(args[1])
    elif op == "mul.rn.f32":
      regs[d] = fval(args[1]) * fval(args[2])
    elif op == "fma.rn.f32":
      regs[d] = fval(args[1]) * fval(args[2]) + fval(args[3])
    elif op in ("mov.f32",):
      regs[d] = fval(args[1])
    elif op in ("mov.b32",):
      regs[d] = regs[args[1]].copy()
    else:
      raise AssertionError(f"PTX op {op!r} is not emulated")
  return regs
