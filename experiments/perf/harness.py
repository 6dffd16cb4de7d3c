"""Shared plumbing of the performance scripts: the Qwen3-8B-shaped random target and its 5-layer
DFlash drafter (the random models of experiments/workflow.py too), random decode states,
compiling and timing decode loops, and timing one jitted step n times on device.

Every setting is an argument (mesh, cache rows, kernels); nothing here is global. A `Case` is one
decode program: models, loop config, batch, prefix and cache capacity.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ddtree_jax import sharding
from ddtree_jax.speculative import auto as auto_lib, decode
from ddtree_jax.models import decoder
from ddtree_jax.tools import profiling
from ddtree_jax.models.config import ModelConfig
from ddtree_jax.models.drafter import DrafterConfig, DrafterParams, quantize_int8, restrict_vocab
from ddtree_jax.models.gated_deltanet import GDNDims
from ddtree_jax.kernels import KernelTuning


def ints(text: str) -> list[int]:
  """'1,8,64' -> [1, 8, 64] (a comma-list flag)."""
  return [int(x) for x in str(text).split(",") if x]


def tuning_overrides(tree_attention: str = "", qkv_splits: int = -1,
                     residual: str = "") -> KernelTuning:
  """A KernelTuning from profile_step's A/B flags, for 16+ token rows (the verify and the drafter
  block, not AR): tree_attention "num_splits=4,block_k=128" (the tree launch parameters);
  qkv_splits >= 0 (the fused q/k/v projection's slices; 0: XLA's GEMM); residual
  "4096=2,12288=4,num_warps=8" (split-K per contracted dim, a dim taking the entry of the
  largest listed dim <= it, 0 = XLA's form; and the kernel's warps). Raises ValueError."""
  pairs = lambda text: [kv.split("=") for kv in text.split(",") if kv]
  kw = {}
  try:
    if tree_attention:
      kw["tree_launch"] = tuple((k, int(v)) for k, v in pairs(tree_attention))
    if qkv_splits >= 0:
      kw.update(qkv_splits=qkv_splits, qkv_rows=(16, 1 << 30))
    if residual:
      override = {k: int(v) for k, v in pairs(residual)}
      if "num_warps" in override:
        kw["residual_warps"] = override.pop("num_warps")
      if override:
        kw.update(residual_rows=(16, 1 << 30), residual_min_depth=1,
                  residual_splits=tuple(sorted(((int(c), s) for c, s in override.items()),
                                               reverse=True)))
  except ValueError:
    raise ValueError(f"tuning overrides take name=int pairs: {tree_attention!r}, "
                     f"{residual!r}") from None
  return KernelTuning(**kw)


def latent_tuning(text: str, interpret=None) -> KernelTuning:
  """'default' -> KernelTuning's rule; 'xla' (or '') -> XLA's latent attention always;
  'SPLIT_ROWSxMAX_SPLITS[:BLOCK_QxBLOCK_KxWARPSxSTAGES]' (e.g. '128x64' or '128x64:64x32x8x2')
  -> the Pallas latent kernel at that launch wherever it runs (KernelTuning's latent_split_rows,
  latent_max_splits, latent_launch). Raises ValueError."""
  if text == "default":
    return KernelTuning(interpret=interpret)
  if text in ("", "xla"):
    return KernelTuning(latent_pallas=False, interpret=interpret)
  splits, _, launch = text.partition(":")
  try:
    rows, max_splits = ints(splits.replace("x", ","))
    kw = {}
    if launch:
      block_q, block_k, warps, stages = ints(launch.replace("x", ","))
      kw["latent_launch"] = (block_q, block_k, warps, stages)
  except ValueError:
    raise ValueError(f"a latent launch is SPLIT_ROWSxMAX_SPLITS[:BLOCK_QxBLOCK_KxWARPSxSTAGES], "
                     f"got {text!r}") from None
  return KernelTuning(latent_pallas=True, latent_tree_rows=1 << 30, latent_tree_capacity=1 << 30,
                      latent_split_rows=rows, latent_max_splits=max_splits, interpret=interpret,
                      **kw)


# --------------------------------------------------------------------------------------------
# Models


SHAPES = ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "moonlight-16b-a3b", "kimi-k2-slice",
          "kimi-k2.6", "qwen3.5-9b", "qwen3.6-35b-a3b")
KIMI_LAYERS = 61  # Kimi K2 / K2.5 / K2.6: the first dense, the other 60 MoE


def target_config(small: bool = False, shape: str = "qwen3-8b",
                  layers: int | None = None) -> ModelConfig:
  """Qwen3-8B's shape (36 layers, hidden 4096, 32 / 8 heads, MLP 12288, vocab 151936), Qwen3-32B's
  (64 layers, hidden 5120, 64 / 8 heads of 128, MLP 25600), or
  Qwen3-30B-A3B's (48 MoE layers, hidden 2048, 32 / 4 heads of 128, 128 experts of width 768,
  top-8, vocab 151936), Moonlight-16B-A3B's (DeepSeek-V3 architecture: 27 layers, hidden 2048,
  16 MLA heads, 64 + 2 shared experts of 1408, top-6, vocab 163840) or a Kimi-K2 slice (its
  first 4 layers: 1 dense, 3 of 384 + 1 shared experts of 2048, top-8; hidden 7168, 64 MLA
  heads, q_lora 1536; 107 GB in bf16) or Kimi K2.6 whole (the same layers, 61 of them, the first
  dense; `layers` cuts it to its first N: one GPU's share of it under 8-way expert parallelism
  is random_target(..., experts="int4", held_experts=48)); the hybrids Qwen3.5-9B (32 layers,
  every 4th gated attention of 16 / 4 heads of 256 with a quarter of each rotated, the others
  Gated DeltaNet of 16 key / 32 value heads of 128, MLP 12288, hidden 4096, vocab 248320) and
  Qwen3.6-35B-A3B (40 such layers at hidden 2048, 16 / 2 attention heads, 256 experts of 512,
  top-8, and a shared expert of 512 behind its gate), as their model cards give them; small: a
  tiny one of the kind for CPU smoke runs (24 experts of 32, hidden 64)."""
  if shape not in SHAPES:
    raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
  if layers is not None and (shape != "kimi-k2.6" or layers < 2):
    raise ValueError(f"target_config: layers={layers} takes shape kimi-k2.6 and at least 2 "
                     "layers (the dense first layer and one MoE layer)")
  if shape in ("kimi-k2-slice", "kimi-k2.6"):  # Kimi-K2's layers (~2 TB in bf16)
    n = 4 if shape == "kimi-k2-slice" else layers or KIMI_LAYERS  # the slice: what one H200 holds
    return ModelConfig(model_type="deepseek_v3", qk_norm=False, scoring_func="sigmoid",
                       norm_topk_prob=True, rope_theta=5e4, max_position_embeddings=8192,
                       vocab_size=512 if small else 163840, hidden_size=64 if small else 7168,
                       intermediate_size=128 if small else 18432, num_layers=n,
                       num_heads=4 if small else 64, num_kv_heads=4 if small else 64,
                       head_dim=24 if small else 192, num_experts=24 if small else 384,
                       num_experts_per_tok=8, moe_intermediate_size=32 if small else 2048,
                       moe_layers=tuple(range(1, n)), n_shared_experts=1,
                       routed_scaling_factor=2.827,
                       q_lora_rank=32 if small else 1536, kv_lora_rank=32 if small else 512,
                       qk_nope_head_dim=16 if small else 128, qk_rope_head_dim=8 if small else 64,
                       v_head_dim=16 if small else 128)
  if shape in ("qwen3.5-9b", "qwen3.6-35b-a3b"):
    return _hybrid_config(small, moe=shape == "qwen3.6-35b-a3b")
  if shape == "moonlight-16b-a3b":  # DeepSeek-V3 architecture: MLA + DeepSeekMoE
    mla = dict(model_type="deepseek_v3", qk_norm=False, scoring_func="sigmoid",
               norm_topk_prob=True, rope_theta=5e4, max_position_embeddings=8192)
    if small:
      return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3,
                         num_heads=4, num_kv_heads=4, head_dim=24, num_experts=16,
                         num_experts_per_tok=3, moe_intermediate_size=32, moe_layers=(1, 2),
                         n_shared_experts=2, routed_scaling_factor=2.446, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **mla)
    return ModelConfig(vocab_size=163840, hidden_size=2048, intermediate_size=11264,
                       num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192,
                       num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                       moe_layers=tuple(range(1, 27)), n_shared_experts=2,
                       routed_scaling_factor=2.446, kv_lora_rank=512, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128, **mla)
  if shape == "qwen3-30b-a3b":
    if small:
      return ModelConfig(model_type="qwen3_moe", vocab_size=512, hidden_size=64,
                         intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=16, rope_theta=1e6, max_position_embeddings=40960,
                         qk_norm=True, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=32, norm_topk_prob=True, moe_layers=(0, 1, 2, 3))
    return ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                       head_dim=128, rope_theta=1e7, max_position_embeddings=40960, qk_norm=True,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       norm_topk_prob=True, moe_layers=tuple(range(48)))
  if small:
    return ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                       rope_theta=1e6, max_position_embeddings=40960)
  if shape == "qwen3-32b":
    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120,
                       intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8,
                       head_dim=128, rope_theta=1e6, max_position_embeddings=40960)
  return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def _hybrid_config(small: bool, moe: bool) -> ModelConfig:
  """Qwen3.5 / 3.6 shapes (`target_config`): every 4th layer gated attention."""
  n = 4 if small else 40 if moe else 32
  h = 64 if small else 2048 if moe else 4096
  types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))
  gdn = GDNDims(key_heads=2 if small else 16, value_heads=4 if small else 32,
                key_dim=16 if small else 128, value_dim=16 if small else 128)
  experts = {} if not moe else dict(
      num_experts=16 if small else 256, num_experts_per_tok=4 if small else 8,
      moe_intermediate_size=32 if small else 512, shared_expert_size=32 if small else 512,
      norm_topk_prob=True, moe_layers=tuple(range(n)))
  return ModelConfig(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
                     vocab_size=512 if small else 248320, hidden_size=h,
                     intermediate_size=128 if small else 12288, num_layers=n,
                     num_heads=4 if small else 16, num_kv_heads=2 if small or moe else 4,
                     head_dim=32 if small else 256, rope_theta=1e7, qk_norm=True,
                     max_position_embeddings=262144, layer_types=types, gdn=gdn,
                     attn_output_gate=True, partial_rotary_factor=0.25, **experts)


def recurrent_bytes(cfg: ModelConfig) -> int:
  """Bytes a step reads and writes per sequence in a hybrid's Gated DeltaNet layers: each
  layer's float32 state in and out, and its bf16 convolution window (0 for other families)."""
  if not cfg.recurrent_layers:
    return 0
  d = cfg.gdn
  per_layer = d.value_heads * d.key_dim * d.value_dim * 4 + (d.conv_kernel - 1) * d.conv_dim * 2
  return 2 * len(cfg.recurrent_layers) * per_layer


def random_target(cfg: ModelConfig, key, mesh=None, fuse_qkv: bool = True, rules=None,
                  dtype=jnp.bfloat16, experts: str = "float",
                  held_experts: int | None = None) -> decoder.Params:
  """Random target weights (bf16 unless dtype says) placed on `mesh` by `rules`, or on one
  device fused (`decoder.fuse_qkv`) as `checkpoint.load_target` does unless fuse_qkv=False;
  routed experts in `experts` format (float: dtype; int4, fp8), only the first `held_experts`
  of them when given (`decoder.init_params`)."""
  params = decoder.init_params(cfg, key, dtype, experts=experts, held_experts=held_experts)
  params = sharding.shard_params(params, mesh, rules)
  return decoder.fuse_qkv(params) if mesh is None and fuse_qkv else params


def drafter_config(tcfg: ModelConfig, small: bool = False, layers: int | None = None,
                   kv_heads: int | None = None, taps: int | None = None) -> DrafterConfig:
  """A 5-layer (2 when small; `layers` when given) dense DFlash drafter of the target's width
  (its MLP of the target's intermediate_size; its kv heads the target's, or `kv_heads`), block
  16, tapping 5 (2) layers spread over the target's, or `taps` layers spread evenly over all
  of the target's (some tapped twice where it has fewer)."""
  hybrid = dict(layer_types=(), gdn=None, attn_output_gate=False, partial_rotary_factor=1.0,
                shared_expert_size=0)
  lcfg = dataclasses.replace(tcfg, model_type="qwen3", num_layers=layers or (2 if small else 5),
                             **hybrid,
                             num_kv_heads=kv_heads or tcfg.num_kv_heads,
                             num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                             norm_topk_prob=False, moe_layers=(), scoring_func="softmax",
                             n_shared_experts=0, routed_scaling_factor=1.0, q_lora_rank=0,
                             kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
                             v_head_dim=0, qk_norm=True,
                             head_dim=16 if small and tcfg.is_mla else
                             128 if tcfg.is_mla or tcfg.gdn else tcfg.head_dim)
  n = tcfg.num_layers
  ids = (1, 2) if small else tuple(1 + i * (n - 4) // 4 for i in range(5))
  if taps:
    ids = tuple(i * (n - 1) // max(taps - 1, 1) for i in range(taps))
  return DrafterConfig(layers=lcfg, block_size=16, mask_token_id=tcfg.vocab_size - 3,
                       target_layer_ids=ids)


def random_drafter_params(tcfg: ModelConfig, dcfg: DrafterConfig, key, dtype=jnp.bfloat16,
                          std: float = 0.02) -> DrafterParams:
  """Random weights of the drafter dcfg for a target of config tcfg: N(0, std^2), norms ones."""
  # its layers only: a vocabulary of 8 spares drawing an embedding and lm_head it does not have
  lcfg = dataclasses.replace(dcfg.layers, vocab_size=8, tie_word_embeddings=True)
  layers = decoder.init_params(lcfg, key, dtype, std).layers
  k1, _ = jax.random.split(key)
  h = tcfg.hidden_size
  return DrafterParams(
      fc=(std * jax.random.normal(k1, (len(dcfg.target_layer_ids) * h, h))).astype(dtype),
      hidden_norm=jnp.ones((h,), dtype), layers=layers, final_norm=jnp.ones((h,), dtype))


def random_drafter(tcfg: ModelConfig, key, small: bool = False, **shape):
  """(random bf16 DrafterParams, DrafterConfig) for a target of config tcfg (`shape`:
  drafter_config's layers, kv_heads, taps)."""
  cfg = drafter_config(tcfg, small, **shape)
  return random_drafter_params(tcfg, cfg, key), cfg


def drafter_variants(dparams, tparams, names, mesh=None, rules=None) -> dict[str, Any]:
  """{name: drafter params} for names "bf16" / "int8" (`drafter.quantize_int8`), each optionally
  with ":vN" (drafting over ids 0..N-1, `drafter.restrict_vocab`), e.g. "int8:v32768"."""
  out = {"bf16": sharding.shard_params(dparams, mesh, rules)}
  if any(n.partition(":")[0] == "int8" for n in names):
    out["int8"] = sharding.shard_params(jax.jit(quantize_int8)(out["bf16"], tparams), mesh,
                                        rules)
  for name in names:
    base, _, size = name.partition(":v")
    if base not in out or (name != base and not (size.isdigit() and int(size) > 0)):
      raise ValueError(f"drafter {name!r}: valid are bf16 or int8, optionally with :vN "
                       "(N > 0 ids), e.g. int8:v32768")
    if name != base:
      out[name] = sharding.shard_params(restrict_vocab(out[base], tparams,
                                                       np.arange(int(size))), mesh, rules)
  return {name: out[name] for name in names}


def random_cache(key, cfg: ModelConfig, batch: int, capacity: int, prefix: int) -> decoder.KVCache:
  """A bf16 KV cache of random rows with `prefix` of them valid per sequence (and a hybrid's
  Gated DeltaNet layers a random state and window)."""
  heads, k_dim, v_dim = cfg.cache_layout  # (MLA: latent rows, no separate values)
  shape = (len(cfg.attention_layers), batch, heads, capacity)
  kk, kv, ks, kw = jax.random.split(key, 4)
  cache = decoder.KVCache(k=jax.random.normal(kk, shape + (k_dim,), jnp.bfloat16),
                          v=jax.random.normal(kv, shape + (v_dim,), jnp.bfloat16),
                          lens=jnp.full((batch,), prefix, jnp.int32))
  if not cfg.recurrent_layers:
    return cache
  empty = decoder.init_target_cache(cfg, batch, 0, jnp.bfloat16)
  return dataclasses.replace(
      cache, state=0.1 * jax.random.normal(ks, empty.state.shape, jnp.float32),
      window=jax.random.normal(kw, empty.window.shape, jnp.bfloat16))


# --------------------------------------------------------------------------------------------
# One decode program


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  """A decode loop to compile and time. dparams / dcfg are None for AR."""
  tparams: Any
  tcfg: ModelConfig
  dparams: Any
  dcfg: DrafterConfig | None
  lc: decode.LoopConfig
  batch: int
  prefix: int
  capacity: int

  @classmethod
  def make(cls, tparams, tcfg, dparams, dcfg, lc, batch, prefix, min_new_tokens: int = 0):
    """Cache rows for the prefix plus max(lc.max_new_tokens, min_new_tokens) and 16 spare."""
    capacity = prefix + max(lc.max_new_tokens, min_new_tokens) + 16
    return cls(tparams, tcfg, dparams, dcfg, lc, batch, prefix, capacity)

  def with_steps(self, steps: int) -> Case:
    """The same program run for `steps` decode steps (the capacity must hold them)."""
    if self.prefix + steps + 1 > self.capacity:
      raise ValueError(f"{steps} steps need {self.prefix + steps + 1} cache rows, the case has "
                       f"{self.capacity}: make it with min_new_tokens >= {steps + 1}")
    return dataclasses.replace(self, lc=dataclasses.replace(self.lc, max_new_tokens=steps + 1))

  def state(self, key=None) -> decode.DecodeState:
    """A random DecodeState: caches of random rows, bonus 11, nothing emitted yet."""
    k1, k2 = jax.random.split(jax.random.key(1) if key is None else key)
    b, m = self.batch, self.lc.max_new_tokens
    state = decode.DecodeState(
        cache=random_cache(k1, self.tcfg, b, self.capacity, self.prefix),
        draft_cache=None if self.dcfg is None else random_cache(k2, self.dcfg.layers, b,
                                                                 self.capacity, self.prefix),
        bonus=jnp.full((b,), 11, jnp.int32), out=jnp.zeros((b, m), jnp.int32),
        n_out=jnp.ones((b,), jnp.int32), done=jnp.zeros((b,), bool),
        accepted=jnp.zeros((m, b), jnp.int32), step=jnp.zeros((), jnp.int32),
        key=jax.random.key(0),
        auto=auto_lib.AutoState.init(
            jnp.ones(len(self.lc.budgets)), b, m, sum(x > 0 for x in self.lc.budgets),
            taps_dim=len(self.dcfg.target_layer_ids) * self.tcfg.hidden_size
            if self.dcfg is not None and self.lc.auto_every == 1 else 0,
            taps_dtype=self.tparams.embed.dtype)
        if self.lc.budgets else None)
    return sharding.shard_params(state, self.lc.mesh, self.lc.rules)

  def state_shape(self):
    """The abstract DecodeState (with the mesh's shardings, which eval_shape drops)."""
    shape = jax.eval_shape(self.state)
    if self.lc.mesh is not None:
      shape = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           shape, sharding.shardings(shape, self.lc.mesh, self.lc.rules))
    return shape

  def compile(self, stages: bool = False):
    """(the AOT-compiled decode loop, its stage programs or None, seconds)."""
    t0 = time.perf_counter()
    shape = self.state_shape()
    loop = decode.decode_loop.lower(self.tparams, self.dparams, shape, tcfg=self.tcfg,
                                    dcfg=self.dcfg, lc=self.lc).compile()
    progs = None
    if stages:
      progs = profiling.compile_stages(self.tparams, self.tcfg, self.dparams, self.dcfg, self.lc,
                                       shape)
    return loop, progs, time.perf_counter() - t0


def compile_cases(cases, threads: int = 1, stages=None):
  """Every case's `compile` (stages[i]: also its stage programs), `threads` at a time (XLA
  compiles outside the GIL); returns when all are compiled, so no timing overlaps a compile."""
  stages = stages or [False] * len(cases)
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
    out = list(ex.map(lambda cs: cs[0].compile(cs[1]), zip(cases, stages)))
  print(f"compiled {len(cases)} programs in {time.perf_counter() - t0:.1f} s "
        f"({threads} threads)", flush=True)
  return out


def time_calls(loop, case: Case, repeats: int):
  """Wall seconds of each of `repeats` calls of a compiled loop (after one warm-up call), each on
  a fresh random state, and the steps a call ran (the same every call)."""
  times, steps = [], 0
  for _ in range(repeats + 1):
    st = jax.block_until_ready(case.state())
    t = time.perf_counter()
    out = jax.block_until_ready(loop(case.tparams, case.dparams, st))
    times.append(time.perf_counter() - t)
    steps = int(out.step)
  return times[1:], steps


def step_seconds(loop, case: Case, repeats: int) -> float:
  """A call's median wall time over the steps it ran (the per-call cost included)."""
  times, steps = time_calls(loop, case, repeats)
  return float(np.median(times)) / steps


def round_seconds(short, short_case: Case, long, long_case: Case, repeats: int):
  """(seconds per round, seconds per call): the slope and intercept of a call's wall time over
  its steps, the short and long loops timed alternately (medians of `repeats` each)."""
  ts, tl, n_short, n_long = [], [], 0, 0
  for _ in range(repeats):
    t, n_short = time_calls(short, short_case, 1)
    ts += t
    t, n_long = time_calls(long, long_case, 1)
    tl += t
  if n_long <= n_short:
    raise ValueError(f"the long loop ran {n_long} steps, the short one {n_short}: raise "
                     "--marginal_steps")
  t_short, t_long = float(np.median(ts)), float(np.median(tl))
  per_round = (t_long - t_short) / (n_long - n_short)
  return per_round, t_short - n_short * per_round


# --------------------------------------------------------------------------------------------
# One kernel or layer: random inputs, n calls on device


def random_tree_mask(rng, b, t):
  """[b, t, t] ancestor-or-self visibility of random trees (node i's parent is < i)."""
  masks = np.zeros((b, t, t), bool)
  for bi in range(b):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    for i in range(t):
      masks[bi, i] = masks[bi, parents[i]] if i else False
      masks[bi, i, i] = True
  return masks


def attention_inputs(rng, b, prefix, t, hq, hkv, d, slack):
  """Random bf16 inputs of the attention contract: q [b, t, hq, d], caches [b, hkv, prefix + slack,
  d] with `prefix` rows valid, new k/v [b, t, hkv, d], a random tree mask [b, t, t]."""
  s = prefix + slack
  key = jax.random.PRNGKey(int(rng.integers(2**31)))
  ks = jax.random.split(key, 5)
  dt = jnp.bfloat16
  q = jax.random.normal(ks[0], (b, t, hq, d), dt)
  k_cache = jax.random.normal(ks[1], (b, hkv, s, d), dt)
  v_cache = jax.random.normal(ks[2], (b, hkv, s, d), dt)
  k_new = jax.random.normal(ks[3], (b, t, hkv, d), dt)
  v_new = jax.random.normal(ks[4], (b, t, hkv, d), dt)
  prefix_len = jnp.full((b,), prefix, jnp.int32)
  mask = jnp.asarray(random_tree_mask(rng, b, t))
  return q, k_cache, v_cache, prefix_len, k_new, v_new, mask


def fori_seconds(step, carry0, consts, round_ms: float, rounds: int, n: int | None = None):
  """(median seconds of one `carry = step(carry, *consts)`, output of one step).

  The step runs n times inside one jitted fori_loop (n static: no host check per iteration; the
  carry chains the calls so none is hoisted). n=None sizes it to ~round_ms from a timed single
  step (one more compile, which also gives the output); a given n skips that (output None)."""
  out = None
  if n is None:
    single = jax.jit(step)
    out = jax.block_until_ready(single(carry0, *consts))  # compile + warm
    est = []
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(single(carry0, *consts))
      est.append(time.perf_counter() - t0)
    n = int(min(max(round_ms * 1e-3 / min(est), 3), 2000))

  @jax.jit
  def run(carry, *consts):
    return lax.fori_loop(0, n, lambda i, c: step(c, *consts), carry)

  jax.block_until_ready(run(carry0, *consts))  # compile + warm
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(run(carry0, *consts))
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times), out
