"""An emulator of the inline-PTX subset the kernels emit, to check their logic on the CPU
(interpret mode runs the kernels' JAX formulas, never the PTX strings).

Values are numpy arrays. Every named register must be declared (``.reg``) with the type
its instruction needs, or the other 32-bit type (PTX lets a ``.b32`` register serve as an
``.f32`` operand and back; the bits are reinterpreted). Covered: ``shl.b32``,
``shr.u32``, ``shf.l.wrap.b32``, ``and.b32``, ``add.u32``, ``lop3.b32``, ``prmt.b32``
(default mode, the
sign-replicating selectors included), ``mov.b32`` (also
the ``{lo, hi}`` split into two b16), ``cvt.f32.f16``, ``neg.f32``, ``mov.f32``,
``mul.rn.f32`` and ``fma.rn.f32`` (the exact product and sum in float64, then one
rounding to float32: double rounding aside, which tolerances absorb), ``fma.rn.bf16x2``
and ``mul.rn.bf16x2`` (per half, the same in float64, then one rounding to bfloat16,
subnormals kept);
immediates ``0x..`` (integers) and ``0f..`` (float32 bits).
"""

import ml_dtypes
import numpy as np

_PTX_TYPES = {"b32": "u", "b16": "h", "f32": "f"}


def _lop3(a, b, c, lut):
  out = np.zeros_like(a)
  for i in range(8):  # truth-table row i: a = bit 2, b = bit 1, c = bit 0
    if lut >> i & 1:
      out |= ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c))
  return out


def _prmt(a, b, selector):
  pool = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
  pool += [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
  out = np.zeros_like(a)
  for i in range(4):
    index = (selector >> (4 * i)) & 0xF
    byte = pool[index & 7]
    if index & 8:  # replicate the selected byte's sign bit
      byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
    out |= byte << np.uint32(8 * i)
  return out


def emulate(asm: str, operands: dict, result: str = "$0") -> np.ndarray:
  """Runs ``asm`` and returns the register ``result`` (an output: ``$0``, or ``$1 ..``
  for asm with several outputs).

  ``operands``: ``{1: uint32 array, 2: float32 array, ...}`` for the inputs ``$1, $2, ...``
  (uint32 for ``r`` constraints, float32 for ``f``); arrays broadcast together.
  """
  types, regs = {}, {}

  def get(tok, kind):
    if tok.startswith("$"):
      v = regs[tok] if tok in regs else operands[int(tok[1:])]
      return np.asarray(v, np.uint32 if kind == "u" else np.float32)
    if tok.startswith("0x"):
      return np.uint32(int(tok, 16))
    if tok.startswith("0f"):
      return np.uint32(int(tok[2:], 16)).view(np.float32)
    if tok.isdigit():
      return int(tok)
    have = types[tok]
    if {have, kind} == {"u", "f"}:  # PTX lets a 32-bit register serve as either type
      return regs[tok].view(np.float32 if kind == "f" else np.uint32)
    assert have == kind, (tok, have, kind)
    return regs[tok]

  def put(tok, kind, value):
    assert tok.startswith("$") or types[tok] == kind, (tok, kind)
    regs[tok] = value

  for line in asm.splitlines():
    line = line.strip().rstrip(";")
    if line in ("{", "}"):
      continue
    op, rest = line.split(None, 1)
    if op == ".reg":
      kind, names = rest.split(None, 1)
      types.update({name.strip(): _PTX_TYPES[kind[1:]] for name in names.split(",")})
      continue
    if op == "mov.b32" and rest.startswith("{"):
      halves, src = rest[1:].split("}, ")
      lo, hi = (h.strip() for h in halves.split(","))
      v = get(src, "u")
      put(lo, "h", (v & 0xFFFF).astype(np.uint16))
      put(hi, "h", (v >> 16).astype(np.uint16))
      continue
    dst, *args = (a.strip() for a in rest.split(","))
    if op in ("shl.b32", "shr.u32"):
      v, amount = get(args[0], "u"), np.uint32(get(args[1], "u"))
      put(dst, "u", (v << amount) if op == "shl.b32" else (v >> amount))
    elif op == "shf.l.wrap.b32":  # the high word of {b, a} << (c mod 32)
      lo, hi = (np.uint64(0) | get(t, "u") for t in args[:2])
      both = (hi << np.uint64(32)) | lo
      amount = np.uint64(int(get(args[2], "u")) % 32)
      put(dst, "u", (((both << amount) >> np.uint64(32)) & np.uint64(0xFFFFFFFF))
          .astype(np.uint32))
    elif op == "mov.b32":
      put(dst, "u", get(args[0], "u"))
    elif op == "and.b32":
      put(dst, "u", get(args[0], "u") & get(args[1], "u"))
    elif op == "add.u32":
      put(dst, "u", get(args[0], "u") + get(args[1], "u"))
    elif op == "lop3.b32":
      a, b, c = (np.uint32(0) | get(t, "u") for t in args[:3])
      put(dst, "u", _lop3(a, b, c, int(args[3], 16)))
    elif op == "prmt.b32":
      a, b = (np.uint32(0) | get(t, "u") for t in args[:2])
      put(dst, "u", _prmt(a, b, int(args[2], 16)))
    elif op == "cvt.f32.f16":
      put(dst, "f", get(args[0], "h").view(np.float16).astype(np.float32))
    elif op == "neg.f32":
      put(dst, "f", -get(args[0], "f"))
    elif op == "mov.f32":
      put(dst, "f", np.float32(1) * get(args[0], "f"))
    elif op == "mul.rn.f32":
      a, b = (np.float64(1) * get(t, "f") for t in args)
      put(dst, "f", (a * b).astype(np.float32))
    elif op == "fma.rn.f32":
      a, b, c = (np.float64(1) * get(t, "f") for t in args)
      put(dst, "f", (a * b + c).astype(np.float32))
    elif op in ("fma.rn.bf16x2", "mul.rn.bf16x2"):
      words = [np.uint32(0) | get(t, "u") for t in args]
      out = np.uint32(0)
      for shift in (0, 16):
        a, b, *c = (((v >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16)
                    .view(ml_dtypes.bfloat16).astype(np.float64) for v in words)
        half = (a * b + c[0] if c else a * b).astype(ml_dtypes.bfloat16)  # keeps -0
        out = out | (half.view(np.uint16).astype(np.uint32) << np.uint32(shift))
      put(dst, "u", out)
    else:
      raise AssertionError(f"the emulator does not know {op!r}")
  return regs[result]
