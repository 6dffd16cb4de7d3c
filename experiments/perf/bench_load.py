"""Loading time and peak host memory of a sharded Kimi K2.5 / K2.6 checkpoint (INT4 experts).

  python -m experiments.perf.bench_load --dir=/tmp/kimi_ckpt          # Kimi K2.6's dims, 3 layers
  python -m experiments.perf.bench_load --small --dir=/tmp/kimi_small  # tiny (smoke)

Writes a `kimi_k25` checkpoint as Moonshot ships one (wrapper config.json with text_config and
its compressed-tensors quantization_config; safetensors shards of at most --shard_gb with a
model.safetensors.index.json; `language_model.` names; routed experts pack-quantized int4 with
bf16 group scales, everything else bf16; random values) unless --dir already holds one, then
loads it with `load_target` in a fresh process (the whole model, or over an `ep` mesh with
--ep) and reports the wall time, the bytes on disk and on the devices, and the peak of the
process's anonymous resident memory (RssAnon, sampled every 10 ms): the memory-mapped shards'
pages are file-backed and not counted, so on a GPU the peak is what the host copies on the way,
and on the CPU backend, whose device buffers are host memory, the peak less the device bytes is.
"""

import json
import os
import subprocess
import sys
import threading
import time

from absl import app, flags
import ml_dtypes
import numpy as np

from ddtree_jax.checkpoints import files
from ddtree_jax.checkpoints.safetensors_io import write_safetensors

flags.DEFINE_string("dir", "", "checkpoint directory (written when it holds no config.json)")
flags.DEFINE_bool("small", False, "tiny dimensions (a CPU smoke run)")
flags.DEFINE_integer("layers", 3, "decoder layers (the first dense, the others MoE)")
flags.DEFINE_integer("experts", 384, "routed experts per MoE layer")
flags.DEFINE_float("shard_gb", 4.0, "the largest safetensors shard, GB")
flags.DEFINE_integer("ep", 0, "load over a mesh of this many devices on the `ep` axis (0: one "
                     "device)")
flags.DEFINE_string("json_out", "", "append the result row as JSON")
flags.DEFINE_string("load_only", "", "internal: load this directory and print a JSON line")
FLAGS = flags.FLAGS

KIMI_K26 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, n_shared_experts=1,
                num_experts_per_tok=8, n_group=1, topk_group=1)
SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, vocab_size=256, n_shared_experts=1,
             num_experts_per_tok=2, n_group=1, topk_group=1)
GROUP = 32


def text_config(dims, layers, experts):
  return dict(dims, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
              num_hidden_layers=layers, num_key_value_heads=dims["num_attention_heads"],
              n_routed_experts=experts, first_k_dense_replace=1, moe_layer_freq=1,
              norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid",
              topk_method="noaux_tc", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0,
              max_position_embeddings=262144, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=1, num_nextn_predict_layers=0,
              rope_scaling=dict(rope_type="yarn", factor=64.0,
                                original_max_position_embeddings=4096, beta_fast=32.0,
                                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
              quantization_config=dict(
                  quant_method="compressed-tensors", format="pack-quantized",
                  quantization_status="compressed",
                  config_groups=dict(group_0=dict(
                      targets=["Linear"], input_activations=None, output_activations=None,
                      weights=dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                   group_size=GROUP, dynamic=False, actorder=None))),
                  ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]))


class _Random:
  """Random tensors without a float copy of each: one block of values, tiled."""

  def __init__(self):
    rng = np.random.default_rng(0)
    self.bf16 = (0.02 * rng.standard_normal(1 << 20)).astype(ml_dtypes.bfloat16)
    self.words = rng.integers(-2**31, 2**31, 1 << 20, dtype=np.int64).astype(np.int32)
    self.scale = (0.003 * (1 + 0.1 * rng.standard_normal(1 << 16))).astype(ml_dtypes.bfloat16)

  def float(self, *shape):
    return np.resize(self.bf16, shape)

  def int4_linear(self, name, out_dim, in_dim):
    return {name + "_packed": np.resize(self.words, (out_dim, in_dim // 8)),
            name + "_scale": np.resize(self.scale, (out_dim, in_dim // GROUP)),
            name + "_shape": np.array([out_dim, in_dim], np.int32)}


def _tensors(cfg):
  """(name, array) of the text model, in checkpoint order, experts one by one."""
  r, h = _Random(), cfg["hidden_size"]
  n, dn, dr, dv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                   cfg["v_head_dim"])
  q, c = cfg["q_lora_rank"], cfg["kv_lora_rank"]
  m = "language_model.model."
  yield m + "embed_tokens.weight", r.float(cfg["vocab_size"], h)
  for i in range(cfg["num_hidden_layers"]):
    p = f"{m}layers.{i}."
    yield p + "input_layernorm.weight", r.float(h)
    yield p + "post_attention_layernorm.weight", r.float(h)
    a = p + "self_attn."
    yield a + "q_a_proj.weight", r.float(q, h)
    yield a + "q_a_layernorm.weight", r.float(q)
    yield a + "q_b_proj.weight", r.float(n * (dn + dr), q)
    yield a + "kv_a_proj_with_mqa.weight", r.float(c + dr, h)
    yield a + "kv_a_layernorm.weight", r.float(c)
    yield a + "kv_b_proj.weight", r.float(n * (dn + dv), c)
    yield a + "o_proj.weight", r.float(h, n * dv)
    if i == 0:
      for name, shape in (("gate", (cfg["intermediate_size"], h)),
                          ("up", (cfg["intermediate_size"], h)),
                          ("down", (h, cfg["intermediate_size"]))):
        yield f"{p}mlp.{name}_proj.weight", r.float(*shape)
      continue
    e, i_dim = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield p + "mlp.gate.weight", r.float(e, h)
    yield p + "mlp.gate.e_score_correction_bias", np.zeros((e,), np.float32)
    s = cfg["n_shared_experts"] * i_dim
    for name, shape in (("gate", (s, h)), ("up", (s, h)), ("down", (h, s))):
      yield f"{p}mlp.shared_experts.{name}_proj.weight", r.float(*shape)
    for j in range(e):
      for name, (o, k) in (("gate", (i_dim, h)), ("up", (i_dim, h)), ("down", (h, i_dim))):
        yield from r.int4_linear(f"{p}mlp.experts.{j}.{name}_proj.weight", o, k).items()
  yield m + "norm.weight", r.float(h)
  yield "language_model.lm_head.weight", r.float(cfg["vocab_size"], h)


def write_checkpoint(path, cfg, shard_bytes):
  """The checkpoint at `path` in shards of at most shard_bytes; returns its bytes on disk."""
  os.makedirs(path, exist_ok=True)
  shards, current, size = [], {}, 0
  for name, t in _tensors(cfg):
    if current and size + t.nbytes > shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = t
    size += t.nbytes
    if size >= shard_bytes:
      shards.append(current)
      current, size = {}, 0
  weight_map, total = {}, 0
  shards += [current] if current else []
  for k, shard in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(os.path.join(path, file), shard)
    weight_map.update(dict.fromkeys(shard, file))
    total += sum(t.nbytes for t in shard.values())
  files.write_json(os.path.join(path, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": weight_map})
  files.write_json(os.path.join(path, "config.json"),
                   dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25",
                        media_placeholder_token_id=cfg["vocab_size"] - 1, text_config=cfg))
  return total


def _rss_anon_kb() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def load_only(path, ep):
  """Loads `path` in this process; prints {load_s, device_bytes, peak_anon_bytes, base}."""
  import jax  # pylint: disable=import-outside-toplevel
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  from ddtree_jax import sharding  # pylint: disable=import-outside-toplevel
  jax.devices()
  base, peak, done = _rss_anon_kb(), [0], threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], _rss_anon_kb())
      time.sleep(0.01)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  t0 = time.perf_counter()
  mesh = sharding.make_mesh({"dp": 1, "tp": 1, "ep": ep}) if ep else None
  target = dj.load_target(path, dtype="bfloat16", mesh=mesh)
  jax.block_until_ready(target.params)
  seconds = time.perf_counter() - t0
  done.set()
  thread.join()
  device = sum(s.data.nbytes for x in jax.tree.leaves(target.params)
               for s in x.addressable_shards)
  print(json.dumps(dict(load_s=seconds, device_bytes=device, peak_anon_bytes=peak[0] * 1024,
                        base_anon_bytes=base * 1024, backend=jax.default_backend(),
                        devices=len(jax.devices()))))


def main(_):
  if FLAGS.load_only:
    load_only(FLAGS.load_only, FLAGS.ep)
    return
  path = FLAGS.dir or ("/tmp/kimi_k25_small" if FLAGS.small else "/tmp/kimi_k25_ckpt")
  cfg = text_config(SMALL if FLAGS.small else KIMI_K26, FLAGS.layers,
                    8 if FLAGS.small else FLAGS.experts)
  if not os.path.exists(os.path.join(path, "config.json")):
    t0 = time.perf_counter()
    write_checkpoint(path, cfg, int(FLAGS.shard_gb * 1e9))
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
  disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
             if f.endswith(".safetensors"))
  shards = sum(f.endswith(".safetensors") for f in os.listdir(path))
  env = dict(os.environ)
  if FLAGS.ep:  # (a CPU backend's devices; a GPU's are its own)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={FLAGS.ep}").strip()
  out = subprocess.run([sys.executable, "-m", "experiments.perf.bench_load",
                        f"--load_only={path}", f"--ep={FLAGS.ep}"], env=env, check=True,
                       capture_output=True, text=True).stdout
  row = json.loads(out.strip().splitlines()[-1])
  row.update(disk_bytes=disk, shards=shards, layers=cfg["num_hidden_layers"],
             experts=cfg["n_routed_experts"], ep=FLAGS.ep)
  extra = row["peak_anon_bytes"] - row["base_anon_bytes"]
  held = row["device_bytes"] if row["backend"] == "cpu" else 0
  print(f"\n== Loading a sharded kimi_k25 INT4 checkpoint ({row['backend']}, {row['devices']} "
        f"device(s), ep={FLAGS.ep or 1})")
  print("layers experts shards  disk GB  device GB  load s  GB/s  peak anon GB  host copy GB")
  print(f"{row['layers']:>6} {row['experts']:>7} {shards:>6} {disk / 1e9:>8.2f} "
        f"{row['device_bytes'] / 1e9:>10.2f} {row['load_s']:>7.1f} "
        f"{disk / 1e9 / row['load_s']:>5.2f} {extra / 1e9:>13.2f} {(extra - held) / 1e9:>13.2f}")
  print("host copy: the peak anonymous memory the load added, less what the devices hold when "
        "they are host memory (CPU backend)")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  app.run(main)
