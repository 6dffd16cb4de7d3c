"""Qwen3 and Llama-3: dense decoders of GQA attention and SwiGLU MLPs (HF `Qwen3ForCausalLM`,
`LlamaForCausalLM`). Qwen3 RMSNorms each head's q and k (`q_norm`, `k_norm`); Llama-3 has no q/k
norm and may scale RoPE (`rope_type: llama3`). The layer readers here (GQA attention, a dense
SwiGLU, the two norms) are shared by the MoE families and the DFlash drafter, whose layers are
Qwen3 layers.

Tensor names: `model.embed_tokens.weight`, `model.layers.{i}.{input,post_attention}_layernorm.
weight`, `self_attn.{q,k,v,o}_proj.weight` (+ `q_norm`, `k_norm`), `mlp.{gate,up,down}_proj.
weight`, `model.norm.weight`, `lm_head.weight` (absent when tied).
"""

from __future__ import annotations

from ddtree_jax.checkpoints.tensor_reader import Joined, Stacked, TensorReader
from ddtree_jax.models.config import ModelConfig, decoder_config
from ddtree_jax.models.decoder import LayerParams, Params
from ddtree_jax.models.family import Family


def swiglu(r: TensorReader, prefix: str, width: int, hidden: int) -> dict:
  """A dense SwiGLU's LayerParams fields: w_gate_up [H, 2, I], w_down [I, H]."""
  gate = r.linear(prefix + "gate_proj.weight", width, hidden)
  up = r.linear(prefix + "up_proj.weight", width, hidden)
  return dict(w_gate_up=Stacked([gate, up], axis=1),
              w_down=r.linear(prefix + "down_proj.weight", hidden, width))


def gqa_layer(r: TensorReader, prefix: str, cfg: ModelConfig, mlp: dict,
              fuse_qkv: bool = False) -> LayerParams:
  """A decoder layer of GQA attention and the MLP fields `mlp`; fuse_qkv: q, k and v as one wqkv
  [H, N + 2K, D] (`decoder.fuse_qkv`'s layout, joined on the host)."""
  h, n, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = prefix + "self_attn."
  kproj = r.linear(a + "k_proj.weight", k * d, h, (k, d))
  vproj = r.linear(a + "v_proj.weight", k * d, h, (k, d))
  wq = r.linear(a + "q_proj.weight", n * d, h, (n, d))
  return LayerParams(
      input_norm=r.get(prefix + "input_layernorm.weight", (h,)),
      wq=None if fuse_qkv else wq,
      wkv=None if fuse_qkv else Stacked([kproj, vproj], axis=1),
      wo=r.get(a + "o_proj.weight", (h, n * d), lambda t: t.T.reshape(n, d, h)),
      q_norm=r.get(a + "q_norm.weight", (d,)) if cfg.qk_norm else None,
      k_norm=r.get(a + "k_norm.weight", (d,)) if cfg.qk_norm else None,
      post_norm=r.get(prefix + "post_attention_layernorm.weight", (h,)),
      wqkv=Joined([wq, kproj, vproj], axis=1) if fuse_qkv else None,
      **mlp)


def dense_layer(r: TensorReader, prefix: str, cfg: ModelConfig,
                fuse_qkv: bool = False) -> LayerParams:
  """A Qwen3 / Llama layer: GQA attention and a dense SwiGLU (also a DFlash drafter's layer)."""
  mlp = swiglu(r, prefix + "mlp.", cfg.intermediate_size, cfg.hidden_size)
  return gqa_layer(r, prefix, cfg, mlp, fuse_qkv)


def decoder_params(r: TensorReader, cfg: ModelConfig, layer) -> Params:
  """The embedding, `layer(r, prefix, i)` for every layer, the final norm and the lm_head."""
  v, h = cfg.vocab_size, cfg.hidden_size
  return Params(embed=r.get("model.embed_tokens.weight", (v, h)),
                layers=[layer(r, f"model.layers.{i}.", i) for i in range(cfg.num_layers)],
                final_norm=r.get("model.norm.weight", (h,)),
                lm_head=None if cfg.tie_word_embeddings else r.linear("lm_head.weight", v, h))


def params(r: TensorReader, cfg: ModelConfig, raw: dict, fuse_qkv: bool = False) -> Params:
  return decoder_params(r, cfg, lambda r, prefix, _: dense_layer(r, prefix, cfg, fuse_qkv))


QWEN3 = Family(model_types=("qwen3",), params=params,
               config=lambda raw, source: decoder_config(raw, source, qk_norm=True))
LLAMA = Family(model_types=("llama",), params=params,
               config=lambda raw, source: decoder_config(raw, source, qk_norm=False))
