"""Test helpers: tiny z-lab-format drafter checkpoints and an oracle drafter with corruption."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models.drafter import DrafterConfig


def write_drafter(path, target_cfg, *, num_layers=2, block_size=8, mask_token_id=5,
                  target_layer_ids=(0, 1), seed=0, std=0.2, config_overrides=None,
                  nest_block_size=False, drop=(), reshape=None, rope=None):
  """Writes a random DFlash drafter (config.json + model.safetensors) matching `target_cfg`.
  rope: config.json fields of the drafter's own RoPE (rope_scaling, or rope_parameters, which
  then holds rope_theta as transformers 5 writes it); None: the target's rope_theta, unscaled."""
  rng = np.random.default_rng(seed)
  h, i = target_cfg.hidden_size, target_cfg.intermediate_size
  n, k, d = target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim
  w = lambda *s: (std * rng.standard_normal(s)).astype(np.float32)
  norm = lambda m: (1 + 0.1 * rng.standard_normal(m)).astype(np.float32)
  t = {"fc.weight": w(h, len(target_layer_ids) * h), "hidden_norm.weight": norm(h),
       "norm.weight": norm(h)}
  for l in range(num_layers):
    p = f"layers.{l}."
    t.update({p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": w(n * d, h), p + "self_attn.k_proj.weight": w(k * d, h),
              p + "self_attn.v_proj.weight": w(k * d, h), p + "self_attn.o_proj.weight": w(h, n * d),
              p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
              p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
              p + "mlp.down_proj.weight": w(h, i)})
  for name in drop:
    del t[name]
  for name, shape in (reshape or {}).items():
    t[name] = np.zeros(shape, np.float32)
  cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
         "intermediate_size": i, "num_hidden_layers": num_layers, "num_attention_heads": n,
         "num_key_value_heads": k, "head_dim": d, "rms_norm_eps": target_cfg.rms_norm_eps,
         "rope_theta": target_cfg.rope_theta, "vocab_size": target_cfg.vocab_size,
         "num_target_layers": target_cfg.num_layers, "tie_word_embeddings": False,
         "dflash_config": {"mask_token_id": mask_token_id,
                           "target_layer_ids": list(target_layer_ids)}}
  if nest_block_size:
    cfg["dflash_config"]["block_size"] = block_size
  else:
    cfg["block_size"] = block_size
  if rope is not None:
    if "rope_theta" in (rope.get("rope_parameters") or {}):
      del cfg["rope_theta"]
    cfg.update(rope)
  cfg.update(config_overrides or {})
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_file(t, os.path.join(path, "model.safetensors"))
  return path


def oracle_ranks(xp, positions, rows, corruption, seed):
  """Where the oracle ranks the true token at each drafted position (xp: jnp or np, uint32
  hashing that both compute alike): 0 first, 1 second (a non-first sibling in a DDTree tree,
  still close enough to enter it at budget 2), 2 nowhere near the top. positions / rows
  broadcast to [B, L]. Returns (rank, confident): `confident` first ranks leave the runner-up far
  behind (deep chains at small budgets), the others keep it close (bushy trees)."""
  u32 = lambda x: xp.asarray(x).astype(xp.uint32)
  c = lambda n: xp.asarray(n, dtype=xp.uint32)
  h = u32(positions) * c(2654435761) + u32(rows) * c(40503) + c(seed * 7919 + 1)
  u = ((h >> 8) % 1000).astype(xp.float32) / 1000.0
  rank = xp.where(u < 1 - corruption, 0, xp.where(u < 1 - corruption / 2, 1, 2))
  return rank, ((h >> 20) % 2) == 0


@dataclasses.dataclass(frozen=True)
class OracleConfig(DrafterConfig):
  """Drafts the target's own continuation (params = (drafter params, ref [B, R])) with
  deterministic corruption (`oracle_ranks`): per drafted position the true token is ranked first
  (prob 1 - c), second (c / 2: reached only through a non-first child) or nowhere near the top
  (c / 2). The real drafter still builds its context; with `over_real` its own draft gives every
  other logit (so its forward runs in the loop and shapes the rest of the tree)."""
  corruption: float = 0.3
  seed: int = 0
  over_real: bool = False

  def draft(self, params, target_params, cache, bonus, kernels=kernels_lib.REFERENCE):
    inner, ref = params
    b, r = ref.shape
    v = self.layers.vocab_size
    pos = cache.lens[:, None] + jnp.arange(1, self.num_drafts + 1)[None]        # [B, L]
    y = jnp.take_along_axis(ref, jnp.minimum(pos, r - 1), axis=1)
    rank, confident = oracle_ranks(jnp, pos, jnp.arange(b)[:, None], self.corruption, self.seed)
    if self.over_real:
      real = super().draft(inner, target_params, cache, bonus, kernels)
      base = real - jnp.max(real, axis=-1, keepdims=True)       # at most 0: below both picks
    else:  # tie-free noise, well inside the 0.5 margin between the two picks
      base = jnp.broadcast_to(0.1 * jax.random.normal(jax.random.key(self.seed), (v,)),
                              (b, self.num_drafts, v))
    other = (y + 1) % v
    y_logit = jnp.where(rank == 0, 8.0, jnp.where(rank == 1, 7.5, -8.0))
    other_logit = jnp.where(rank == 0, jnp.where(confident, 3.0, 7.5), 8.0)
    ids = jnp.arange(v)
    logits = jnp.where(ids == other[..., None], other_logit[..., None], base)
    return jnp.where(ids == y[..., None], y_logit[..., None], logits)

  def context(self, params, taps, positions):
    return super().context(params[0], taps, positions)

  def vocab(self, params):
    return None  # draft's logits cover the whole vocabulary


def oracle_drafter(drafter, ar_prompts, ar_tokens, corruption=0.3, seed=0, length=512,
                   over_real=False):
  """A Drafter-like (params, config) pair whose drafts follow the AR reference sequences."""
  ref = np.zeros((len(ar_prompts), length), np.int32)
  for b, (p, o) in enumerate(zip(ar_prompts, ar_tokens)):
    seq = list(p) + list(o)
    ref[b, :len(seq)] = seq
  cfg = OracleConfig(**{f.name: getattr(drafter.config, f.name)
                        for f in dataclasses.fields(DrafterConfig)},
                     corruption=corruption, seed=seed, over_real=over_real)
  return dataclasses.replace(drafter, params=(drafter.params, jnp.asarray(ref)), config=cfg)


def oracle_counts(oracle, prompts, res):
  """What a run with an oracle drafter committed, replayed from its acceptance lengths:
  (steps that committed 3+ tokens, steps whose accepted path runs through a non-first child,
  i.e. past a position where the true token was the drafter's second choice)."""
  cfg = oracle.config
  multi = branch = 0
  for row, (prompt, lens) in enumerate(zip(prompts, res.stats["acceptance_lengths"])):
    start = len(prompt)
    for a in lens:
      pos = start + np.arange(1, a)  # the accepted drafted nodes' positions
      rank, _ = oracle_ranks(np, pos, np.full_like(pos, row), cfg.corruption, cfg.seed)
      multi += a >= 3
      branch += bool(np.any(rank == 1))
      start += a
  return multi, branch


def prefilled(target, prompt, capacity=64):
  """(hidden [1, T, H], a float32 cache of `capacity` rows holding the prompt's T rows)."""
  from ddtree_jax.models import decoder  # pylint: disable=import-outside-toplevel
  cache = decoder.init_target_cache(target.config, 1, capacity, jnp.float32)
  t = len(prompt)
  pos = jnp.arange(t)[None]
  hidden, rows, _ = decoder.forward(target.params, target.config, jnp.asarray(prompt)[None], pos,
                                    cache, decoder.causal_mask(jnp.array([t]), t), chain=True)
  return hidden, decoder.commit(cache, rows, pos, jnp.array([t]))


def cached_decode_logits(target, prompt, greedy):
  """Prompt prefill, then one cached step per given greedy token: the logits [len(greedy), V]
  of each step (what HF's generate reports as decode_logits)."""
  from ddtree_jax.models import decoder  # pylint: disable=import-outside-toplevel
  cfg, params = target.config, target.params
  hidden, cache = prefilled(target, prompt)
  got = [decoder.lm_head(params, hidden[0, -1])]
  for tok in greedy[:-1]:
    hidden, rows, _ = decoder.forward(params, cfg, jnp.array([[tok]]), cache.lens[:, None],
                                      cache, jnp.ones((1, 1, 1), bool))
    cache = decoder.commit(cache, rows, jnp.zeros((1, 1), jnp.int32), jnp.array([1]))
    got.append(decoder.lm_head(params, hidden[0, 0]))
  return jnp.stack(got)


def slot_server_tokens(target, drafter, prompts, limits, config):
  """What a started `slots.SlotEngine(target, drafter, config)` streams for each of `prompts`
  (all submitted before it starts; limits: each one's max_new_tokens), once all are done."""
  import threading  # pylint: disable=import-outside-toplevel
  from ddtree_jax.request import GenerateOptions  # pylint: disable=import-outside-toplevel
  from ddtree_jax.serving import slots  # pylint: disable=import-outside-toplevel
  engine = slots.SlotEngine(target, drafter, config)
  got = [[] for _ in prompts]
  done = [threading.Event() for _ in prompts]

  def emit(i):
    def call(toks, reason):
      got[i].extend(toks)
      if reason:
        done[i].set()
    return call
  try:
    for i, (p, n) in enumerate(zip(prompts, limits)):
      engine.submit(p, GenerateOptions(max_new_tokens=n, stop_token_ids=()), emit(i))
    engine.start()
    assert all(d.wait(300) for d in done)
  finally:
    engine.stop()
  return got


def copy_fixture(tmp_path, name="qwen3_gqa"):
  """A private copy of tests/fixtures/hf/<name> under tmp_path (to edit or break)."""
  dst = str(tmp_path / name)
  shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "hf", name), dst)
  return dst


def edit_config(path, **changes):
  """Updates the config.json of the checkpoint directory `path`."""
  file = os.path.join(path, "config.json")
  with open(file) as f:
    cfg = json.load(f)
  cfg.update(changes)
  with open(file, "w") as f:
    json.dump(cfg, f)


def write_target(path, *, heads=8, kv_heads=8, hidden=64, head_dim=16, inter=128, vocab=256,
                 layers=2, seed=0):
  """A random Qwen3 HF checkpoint (config.json + model.safetensors, float32, untied)."""
  rng = np.random.default_rng(seed)
  w = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)
  norm = lambda m: (1 + 0.1 * rng.standard_normal(m)).astype(np.float32)
  t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": norm(hidden),
       "lm_head.weight": w(vocab, hidden)}
  for l in range(layers):
    p = f"model.layers.{l}."
    t.update({p + "input_layernorm.weight": norm(hidden),
              p + "post_attention_layernorm.weight": norm(hidden),
              p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": norm(head_dim),
              p + "self_attn.k_norm.weight": norm(head_dim),
              p + "mlp.gate_proj.weight": w(inter, hidden),
              p + "mlp.up_proj.weight": w(inter, hidden),
              p + "mlp.down_proj.weight": w(hidden, inter)})
  cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
         "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
         "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "vocab_size": vocab, "tie_word_embeddings": False,
         "max_position_embeddings": 512, "eos_token_id": 1, "bos_token_id": 0}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_file(t, os.path.join(path, "model.safetensors"))
  return path


# A random 2-layer target, a block-8 drafter for it and AR's 24 tokens for four ragged prompts
# (the int8 and draft-vocabulary drafter tests).
PAIR_PROMPTS = [[3, 17, 99, 4, 250, 31, 8], [42], [7] * 12 + [9], [200, 1, 0]]
PAIR_NEW_TOKENS = 24


def small_pair(root):
  """(float32 target, drafter checkpoint path, AR tokens of PAIR_PROMPTS) under folder root."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  target = dj.load_target(write_target(os.path.join(root, "target")), dtype="float32")
  path = write_drafter(os.path.join(root, "drafter"), target.config, block_size=8)
  ar = dj.generate(target, PAIR_PROMPTS, max_new_tokens=PAIR_NEW_TOKENS, stop_token_ids=()).tokens
  return target, path, ar


# Lowering for CUDA on a machine without a GPU: an abstract H200 makes the Pallas Triton lowering
# rule run, which emits the Triton module as a serialized custom call. We also parse that module
# back and run the MLIR verifier on it (catches ill-typed Triton IR before it reaches a GPU).


def abstract_h200_mesh():
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType
  dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  return AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)


def triton_custom_calls(lowered):
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if inner.operation.name == "stablehlo.custom_call":
            found.append(inner.operation)
          walk(inner.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  return [op for op in found if "__gpu$xla.gpu.triton" in str(op.attributes["call_target_name"])]


def verify_triton_ir(call):
  """Parse the serialized Triton module of one custom call and run the MLIR verifier on it."""
  try:
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering
  except ImportError:  # internal API moved: the custom-call check above still stands
    return None
  cfg = call.attributes["mhlo.backend_config"]
  data = ir.StringAttr(cfg["ir"]).value_bytes
  with triton_lowering._new_ir_context():  # pylint: disable=protected-access
    module = ir.Module.parse(data)
    assert module.operation.verify()
    return module.operation.get_asm()


def assert_accepted(oracle, prompts, res, method, budget=None):
  """An oracle run really committed drafts: some step kept 3+ tokens (2 at budget 1, the most
  it can) and, for a tree of budget >= 2, some accepted path ran through a non-first child;
  chain and budget-1 trees, which hold first choices only, never do (checks the replay too)."""
  lens = [a for seq in res.stats["acceptance_lengths"] for a in seq]
  multi, branch = oracle_counts(oracle, prompts, res)
  if method == "ddtree" and budget == 1:
    assert max(lens) == 2, lens
  else:
    assert multi > 0, lens
  if method == "ddtree" and budget >= 2:
    assert branch > 0, (budget, lens)
  else:
    assert branch == 0, (method, budget, lens)


def assert_lossless(target, drafter, prompts, ar, method, budget, max_new_tokens, seed=0):
  """Chain / DDTree with an oracle drafter (drafts that follow `ar`, partly corrupted) give
  exactly the AR tokens `ar`, committing multi-token paths and non-first children
  (`assert_accepted`)."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  d = oracle_drafter(drafter, prompts, ar, seed=seed)
  res = dj.generate(target, prompts, method=method, drafter=d, budget=budget,
                    max_new_tokens=max_new_tokens, stop_token_ids=())
  assert res.tokens == ar
  assert_accepted(d, prompts, res, method, budget)


def assert_real_drafter_lossless(target, drafter, prompts, ar, n=12):
  """The drafter's own forward in the loop, on XLA (chain) and on the Pallas kernels (DDTree
  B=16), giving every logit but the oracle's two picks (`over_real`), so its drafts shape trees
  whose paths get accepted: AR's tokens."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  ar = [a[:n] for a in ar]
  over = oracle_drafter(drafter, prompts, ar, over_real=True)
  for method, budget, attention in (("chain", None, "xla"), ("ddtree", 16, "pallas")):
    res = dj.generate(target, prompts, method=method, drafter=over, budget=budget,
                      max_new_tokens=n, stop_token_ids=(), attention=attention)
    assert res.tokens == ar, (method, attention)
    assert_accepted(over, prompts, res, method, budget)


def drafter_and_ar(path, target, prompts, max_new_tokens, target_layer_ids):
  """(a random block-8 drafter written to `path` and loaded for `target`, AR's tokens)."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  drafter = dj.load_drafter(write_drafter(path, target.config, block_size=8,
                                          target_layer_ids=target_layer_ids), target)
  return drafter, dj.generate(target, prompts, max_new_tokens=max_new_tokens,
                              stop_token_ids=()).tokens


def load_fixture(name, **kw):
  """(float32 Target, its reference.npz) of tests/fixtures/hf/<name>; kw to `load_target`."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(__file__), "fixtures", "hf", name)
  return dj.load_target(path, dtype="float32", **kw), np.load(os.path.join(path, "reference.npz"))


def assert_close_rel(a, b, rel=1e-4):
  """Same shape, and max |a - b| within rel of max |b|."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape
  assert np.max(np.abs(a - b)) <= rel * np.max(np.abs(b)), np.max(np.abs(a - b))
