"""Mixture-of-experts step benchmark: a Qwen3-30B-A3B-shaped target (48 MoE layers, hidden 2048,
32 / 4 heads of 128, 128 experts of width 768, top-8, vocab 151936; random bf16 weights) or,
with --shape=moonlight-16b-a3b, a DeepSeek-V3-architecture one (27 layers, hidden 2048, 16
latent-attention heads, kv_lora_rank 512, 64 routed + 2 shared experts of 1408, top-6, first
layer dense, vocab 163840), or with --shape=kimi-k2-slice Kimi-K2's first 4 layers (hidden 7168,
64 latent-attention heads, 384 + 1 shared experts of 2048, top-8; 108 GB), and a 5-layer dense
DFlash drafter (built only for the loop section), prefix 1K.

  python -m experiments.perf.bench_moe             # one H200
  python -m experiments.perf.bench_moe --small     # tiny shapes on CPU (smoke)

Sections, in one run (rows printed as JSON lines as they are measured, tables at the end),
after the floors' bandwidth row (`floors.measure`; written by every run, and alone by
--sections=bandwidth, whose old name copy still works):
  verify   the whole target forward of T tokens (embedding, every layer, lm_head on every row)
           over the prefix under a random tree mask, Pallas kernels: T = 1 is the AR forward;
           --verify_layers also times the target cut to its first N layers (the same arrays),
           so a slice's per-layer cost is a difference of two rows
  experts  the 48 MoE layers alone (x <- x + moe(x), router included) over T token rows, for each
           expert-GEMM implementation (--impls): XLA's ragged_dot, the Pallas grouped GEMM at
           given tiles, pair by pair (one tile each, no sort), one dense einsum over all
           experts; against the floor of the experts the rows touch
  loop     the decode loop's step (lax.while_loop, Pallas kernels): AR, chain and DDTree by
           budget at each batch, with the distinct experts the verify of B + 1 random tokens
           routes to per layer (the batch's union)

Floors are the bytes a step must read at the floors' bandwidth (and at the card's spec
bandwidth: the x spec columns): attention weights, routers, the lm_head, the KV prefix and, per
layer, the distinct experts the step's rows route to (counted in the same run, from the same
inputs' routing). Random weights route near uniformly; a trained
router concentrates more, so real trees touch fewer experts. A loop row's floor is its target
forward's (`target_` keys: the drafter's bytes not counted).
"""

import dataclasses
import functools
import json

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine, sharding
from ddtree_jax.speculative import decode
from ddtree_jax.models import decoder
from ddtree_jax.models import moe
from ddtree_jax.kernels import KernelTuning, Kernels
from ddtree_jax.pallas import moe_ops
from experiments.perf import common_flags, floors, harness

common_flags.define("small", "prefix", "repeats", "compile_threads", "floor_bandwidth",
                    "json_out")
flags.DEFINE_enum("attention", "pallas", ["pallas", "xla"], "the verify and loop sections' "
                  "kernels (Kernels.attention; xla: a CPU smoke without interpreted kernels)")
flags.DEFINE_string("latent", "default", "MLA shapes' latent attention: default (KernelTuning's "
                    "rule), xla, or the Pallas kernel wherever it runs at a launch SPLIT_ROWSx"
                    "MAX_SPLITS[:BLOCK_QxBLOCK_KxWARPSxSTAGES] (harness.latent_tuning)")
flags.DEFINE_string("shape", "qwen3-30b-a3b", "target shape: qwen3-30b-a3b, moonlight-16b-a3b or "
                    "kimi-k2-slice (DeepSeek-V3 architecture: latent attention, shared experts)")
flags.DEFINE_string("sections", "experts,verify,loop", "comma list of: experts, verify, loop "
                    "(the bandwidth row comes first whatever it says)")
flags.DEFINE_string("tokens", "1,17,65,2048", "experts section: token rows T")
flags.DEFINE_string("impls", "xla,pallas:16x64x128,pallas:16x128x64,pallas:64x128x64",
                    "experts section: xla (ragged_dot), pallas (KernelTuning's rule), "
                    "pallas:BMxBNxBK (fixed tiles), pairs (pair by pair, one tile each), "
                    "pairs:BMxBNxBK, xla_pairs (XLA's pair form), decode (the decode kernels "
                    "as Kernels.moe runs them: the router kernel, then routed inside the gate/up "
                    "kernel), decode:VARIANT (a --moe_decode variant), "
                    "dense (every expert; T <= 65 only)")
flags.DEFINE_string("moe_decode", "default", "loop section: the MoE decode kernels, each of "
                    "this comma list in turn: default (KernelTuning's), off (the pair kernels "
                    "instead), a launch GUxBKxWARPS, or KEY=VALUE pairs joined by '+' "
                    "(decode_variant: launch, fill, down_fill, down, router)")
flags.DEFINE_string("verify_tokens", "1,9,17,33,65", "verify section: tokens T (batch 1)")
flags.DEFINE_string("verify_layers", "", "verify section: also the target cut to its first N "
                    "layers, for each N of this comma list ('' = all layers only)")
flags.DEFINE_string("loop_runs", "1:ar,chain,1,4,16,32,64,128,512;8:ar,chain,4,16,64,128",
                    "loop section: 'batch:run,run;...', a run ar, chain or a DDTree budget (ar "
                    "first: the x AR column); each batch compiled, then timed, in turn")
flags.DEFINE_integer("steps", 8, "decode steps timed per loop row")
sharding.define_mesh_flags()
sharding.define_layout_flag()
FLAGS = flags.FLAGS

ROWS = []


def emit(row):
  row.update(tp=FLAGS.mesh_tp, ep=FLAGS.mesh_ep, layout=FLAGS.mesh_layout, latent=FLAGS.latent)
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def experts_impl(name: str, tuning: KernelTuning, routing: moe.Routing):
  """A MoE layer (params, x) -> [R, H], router included, by --impls name."""
  kind, _, blocks = name.partition(":")
  if kind == "decode":  # the decode kernels as Kernels runs them, at a --moe_decode variant
    layer = Kernels("pallas", tuning=decode_variant(blocks or "default", tuning)).moe
    return lambda p, x: layer(p, x, routing=routing)
  blocks = tuple(int(v) for v in blocks.split("x")) if blocks else None
  if kind == "xla":
    fn = moe.grouped
  elif kind == "xla_pairs":  # each pair's expert gathered (a copy per pair)
    fn = moe.pairs
  elif kind == "dense":
    fn = moe.reference
  elif kind == "pallas":
    fn = functools.partial(moe.grouped, ops=moe_ops.expert_ops(tuning, blocks))
  elif kind == "pairs":
    fn = functools.partial(moe.pairs, ops=moe_ops.pair_ops(tuning, blocks))
  else:
    raise app.UsageError(f"--impls: unknown {name!r}")
  return lambda p, x: fn(p, x, *moe.route(p, x, routing))


DECODE_KEYS = {  # --moe_decode's KEY=VALUE: the KernelTuning fields of the decode path
    "launch": ("moe_decode_launch", 3), "fill": ("moe_decode_fill", 1),
    "down_fill": ("moe_down_fill_width", 1), "down": ("moe_pair_blocks", 3),
    "router": ("moe_router_launch", 4)}


def decode_variant(name: str, tuning: KernelTuning) -> KernelTuning:
  """--moe_decode's variant of the tuning: default, off (the pair kernels, XLA's routing), a
  launch GUxBKxWARPS, or KEY=VALUE pairs joined by '+' (DECODE_KEYS; values NxN..., e.g.
  'fill=0+router=0x0x0x0')."""
  if name == "default":
    return tuning
  if name == "off":
    return dataclasses.replace(tuning, moe_decode_max=0, moe_decode_quant_max=0)
  changes = {}
  for part in name.split("+"):
    key, eq, value = part.partition("=")
    if not eq:
      key, value = "launch", part
    if key not in DECODE_KEYS:
      raise app.UsageError(f"--moe_decode: {part!r}: keys are {sorted(DECODE_KEYS)}")
    field, n = DECODE_KEYS[key]
    try:
      values = tuple(int(v) for v in value.split("x"))
    except ValueError:
      values = ()
    if len(values) != n:
      raise app.UsageError(f"--moe_decode: {part!r} needs {n} integer(s) joined by 'x'")
    changes[field] = values if n > 1 else (bool(values[0]) if key == "fill" else values[0])
    if key == "launch":
      changes["moe_decode_quant_launch"] = values
  return dataclasses.replace(tuning, **changes)


def counting_kernels(base: Kernels, counts: list):
  """`base` whose MoE layers also append the distinct experts their rows route to (traced)."""
  k = Kernels(base.attention, base.mesh, base.rules, base.tuning)
  inner = base.moe

  def mixture(params, x, *, routing):
    _, chosen = moe.route(params, x, routing)
    counts.append(moe.distinct_experts(chosen, params.router.shape[1]))
    return inner(params, x, routing=routing)
  fused = base.moe_residual

  def block(params, x, h, shared, norm, *, routing, eps):
    _, chosen = moe.route(params, h, routing)
    counts.append(moe.distinct_experts(chosen, params.router.shape[1]))
    return fused(params, x, h, shared, norm, routing=routing, eps=eps)
  # Kernels' properties are cached: this instance's values
  k.__dict__["moe"], k.__dict__["moe_residual"] = mixture, block
  return k


def first_layers(params, cfg, n: int):
  """(params, cfg) of the target's first n layers (the same arrays): a slice's per-layer cost is
  the difference of two such forwards."""
  if not 1 <= n <= cfg.num_layers:
    raise ValueError(f"--verify_layers: {n} is not in [1, {cfg.num_layers}]")
  return (dataclasses.replace(params, layers=params.layers[:n]),
          dataclasses.replace(cfg, num_layers=n,
                              moe_layers=tuple(l for l in cfg.moe_layers if l < n)))


def main(_):
  common_flags.start()
  small, sections = FLAGS.small, FLAGS.sections.split(",")
  tcfg = harness.target_config(small, FLAGS.shape)
  mesh, rules = sharding.mesh_from_flags(), sharding.rules_from_flags()
  if mesh is not None and "experts" in sections:
    raise app.UsageError("--sections=experts times the expert GEMMs on one device")
  if mesh is not None and tcfg.num_kv_heads % dict(mesh.shape)["tp"]:
    rules = dataclasses.replace(rules, kv_heads=None)  # kv heads replicated where tp > K
  tp = harness.random_target(tcfg, jax.random.key(0), mesh, rules=rules)
  dp, dcfg = (harness.random_drafter(tcfg, jax.random.key(1), small) if "loop" in sections
              else (None, None))
  dp = sharding.shard_params(dp, mesh, rules)
  kern = Kernels(FLAGS.attention, mesh, rules, tuning=harness.latent_tuning(FLAGS.latent))
  # expert counts: on a GPU the Pallas experts (XLA's ragged_dot autotunes on copies of a layer's
  # weights, more than a Kimi-K2 layer leaves free); on a CPU XLA's (Pallas would be interpreted)
  on_gpu = jax.default_backend() == "gpu"
  count_kern = kern if on_gpu else Kernels("xla", mesh, rules)
  layers = [l.moe for l in tp.layers if l.moe is not None]  # (dense layers are in dense_bytes)
  e, h, _, inter = layers[0].w_gate_up.shape
  k_top = tcfg.num_experts_per_tok
  expert_bytes = 3 * h * inter * layers[0].w_gate_up.dtype.itemsize
  router_bytes = sum(l.router.size * 4 for l in layers)
  prefix = FLAGS.prefix
  bw = floors.measure(small, FLAGS.floor_bandwidth)
  print(bw.describe(), flush=True)
  emit(bw.row())

  def floor_bytes(counts, b, p=tp, c=tcfg):
    """Bytes a forward must read, per device of the mesh (each byte read by one of them at
    least): the non-expert weights (lm_head, not the embedding), the distinct experts per layer
    `counts`, b prefixes of KV rows (the attention layers') and a hybrid's b recurrent states
    read and written."""
    experts = sum(l.moe.w_gate_up.nbytes + l.moe.w_down.nbytes for l in p.layers if l.moe)
    heads, k_dim, v_dim = c.cache_layout
    kv = len(c.attention_layers) * heads * (k_dim + v_dim) * 2
    dense = decoder.param_bytes(p) - experts - p.embed.nbytes
    return (dense + int(np.sum(counts)) * expert_bytes
            + b * (prefix * kv + harness.recurrent_bytes(c))) / (1 if mesh is None else mesh.size)

  print(f"devices {jax.devices()}  target {decoder.param_bytes(tp) / 1e9:.2f} GB (routers "
        f"{router_bytes / 1e9:.3f}, floor of the non-expert weights and a 1-row prefix "
        f"{bw.floor_ms(floor_bytes([], 1)):.3f} ms)  expert {expert_bytes / 1e6:.2f} MB  drafter "
        f"{decoder.param_bytes(dp) / 1e9 if dp else 0:.2f} GB", flush=True)
  def random_state(b, t, key, c=tcfg):
    rng = np.random.default_rng(key)
    cache = harness.random_cache(jax.random.key(key), c, b, prefix + t + 16, prefix)
    toks = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, t)), jnp.int32)
    pos = prefix + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.asarray(harness.random_tree_mask(rng, b, t))
    rows = [sharding.replicate(x, mesh) for x in (toks, pos, mask)]
    return rows[0], rows[1], sharding.shard_params(cache, mesh, rules), rows[2]

  def routed(b, t, key=0, p=tp, c=tcfg):
    """Distinct experts per layer [L] of a verify of t random tokens per sequence (batch b), the
    batch's union. Run eagerly (op by op): a compile per shape would cost more than the run."""
    toks, pos, cache, mask = random_state(b, t, key, c)
    counts = []
    decoder.forward(p, c, toks, pos, cache, mask, kernels=counting_kernels(count_kern, counts))
    return np.asarray(jnp.stack(counts))

  if "verify" in sections:
    for n in harness.ints(FLAGS.verify_layers) or [tcfg.num_layers]:
      p, c = first_layers(tp, tcfg, n)

      @functools.partial(jax.jit, static_argnums=0)
      def verify_forward(c, p, toks, pos, cache, mask):
        hidden, _, _ = decoder.forward(p, c, toks, pos, cache, mask, kernels=kern)
        return jnp.argmax(decoder.lm_head(p, hidden), axis=-1)

      for t in harness.ints(FLAGS.verify_tokens):
        counts = routed(1, t, p=p, c=c)
        s = harness.profiling.median_seconds(verify_forward, c, p, *random_state(1, t, 0, c),
                                             repeats=FLAGS.repeats)
        emit(floors.mark({"section": "verify", "layers": n, "tokens": t,
                          "distinct_per_layer": float(counts.mean()), "ms": s * 1e3},
                         s * 1e3, floor_bytes(counts, 1, p, c), bw))

  if "experts" in sections:
    def chain(layer):
      def run(ls, x):
        for p in ls:
          x = x + layer(p, x)
        return x
      return jax.jit(run)

    count_experts = (functools.partial(moe.grouped, ops=moe_ops.expert_ops(kern.tuning))
                     if on_gpu else moe.grouped)

    @jax.jit
    def count_chain(ls, x):
      out = []
      for p in ls:
        w, c = moe.route(p, x, tcfg.routing)
        out.append(moe.distinct_experts(c, e))
        x = x + count_experts(p, x, w, c)
      return jnp.stack(out)

    for t in harness.ints(FLAGS.tokens):
      x = jax.random.normal(jax.random.key(t), (t, h), jnp.bfloat16)
      counts = np.asarray(count_chain(layers, x))
      nbytes = router_bytes + int(counts.sum()) * expert_bytes
      want = None
      for name in FLAGS.impls.split(","):
        if name == "dense" and t > 65:
          continue
        try:
          fn = chain(experts_impl(name, kern.tuning, tcfg.routing))
          got = np.asarray(fn(layers, x), np.float32)
          s = harness.profiling.median_seconds(fn, layers, x, repeats=FLAGS.repeats)
        except Exception as err:  # pylint: disable=broad-except  (a failed launch is a row)
          emit({"section": "experts", "impl": name, "tokens": t, "error": str(err)[:300]})
          continue
        want = got if want is None else want  # the first impl's output is the yardstick
        delta = np.abs(got - x.astype(jnp.float32)), np.abs(want - x.astype(jnp.float32))
        emit(floors.mark({"section": "experts", "impl": name, "tokens": t, "pairs": t * k_top,
                          "distinct_per_layer": float(counts.mean()), "ms": s * 1e3,
                          "max_rel_diff_vs_first": float(np.max(np.abs(got - want))
                                                         / np.max(delta[1]))},
                         s * 1e3, nbytes, bw))
        del delta

  if "loop" in sections:
    for group, variant in [(g, v) for g in FLAGS.loop_runs.split(";")
                           for v in FLAGS.moe_decode.split(",")]:
      b, _, runs = group.partition(":")
      b, rows = int(b), []
      vk = dataclasses.replace(kern, tuning=decode_variant(variant, kern.tuning))
      for run in runs.split(","):
        method = run if run in ("ar", "chain") else "ddtree"
        budget = int(run) if method == "ddtree" else 0
        lc = decode.LoopConfig(kernels=vk, method=method, max_new_tokens=FLAGS.steps + 1,
                               num_drafts=0 if method == "ar" else dcfg.num_drafts,
                               budget=budget)
        d = (None, None) if method == "ar" else (dp, dcfg)
        rows.append((run, harness.Case.make(tp, tcfg, d[0], d[1], lc, b, prefix)))
      compiled = harness.compile_cases([c for _, c in rows], FLAGS.compile_threads)
      ar_ms = None
      for (run, case), (loop, _, compile_s) in zip(rows, compiled):
        t = 1 if run == "ar" else dcfg.block_size if run == "chain" else int(run) + 1
        counts = routed(b, t, key=t)
        s = harness.step_seconds(loop, case, FLAGS.repeats) * 1e3
        ar_ms = ar_ms or s
        emit(floors.mark({"section": "loop", "run": run, "batch": b, "moe_decode": variant,
                          "verify_tokens": t, "distinct_per_layer": float(counts.mean()),
                          "step_ms": s, "vs_ar": s / ar_ms, "compile_s": compile_s},
                         s, floor_bytes(counts, b), bw, prefix="target_"))
  print_tables()
  floors.check(ROWS)


def print_tables():
  print("\n== MoE layers alone (router + experts, every layer) vs touched-experts floor")
  print(f"{'impl':<20}{'T':>6}{'experts/layer':>15}{'ms':>9}{'floor ms':>10}{'ratio':>8}"
        f"{'x spec':>8}")
  for r in ROWS:
    if r["section"] == "experts" and "ms" in r:
      print(f"{r['impl']:<20}{r['tokens']:>6}{r['distinct_per_layer']:>15.1f}{r['ms']:>9.3f}"
            f"{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}{floors.x_spec(r)}  (max diff vs "
            f"first impl {r['max_rel_diff_vs_first']:.1e} of the update){floors.flag(r)}")
  print("\n== Target forward of T tokens (batch 1) vs touched-experts floor")
  print(f"{'layers':>6}{'T':>6}{'experts/layer':>15}{'ms':>9}{'floor ms':>10}{'ratio':>8}"
        f"{'x spec':>8}")
  for r in ROWS:
    if r["section"] == "verify":
      print(f"{r['layers']:>6}{r['tokens']:>6}{r['distinct_per_layer']:>15.1f}{r['ms']:>9.3f}"
            f"{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}{floors.x_spec(r)}"
            f"{floors.flag(r)}")
  print("\n== Decode loop step (AR, chain, DDTree by budget) vs its target forward's floor")
  print(f"{'run':<7}{'batch':>6}{'moe decode':>12}{'T':>5}{'experts/layer':>15}{'step ms':>10}"
        f"{'x AR':>7}{'floor ms':>10}{'ratio':>8}{'x spec':>8}")
  for r in ROWS:
    if r["section"] == "loop":
      print(f"{r['run']:<7}{r['batch']:>6}{r['moe_decode']:>12}{r['verify_tokens']:>5}"
            f"{r['distinct_per_layer']:>15.1f}{r['step_ms']:>10.3f}{r['vs_ar']:>7.2f}"
            f"{r['target_floor_ms']:>10.3f}{r['target_ratio_to_floor']:>8.2f}"
            f"{floors.x_spec(r, 'target_')}{floors.flag(r, 'target_')}")


if __name__ == "__main__":
  engine.define_compilation_cache_flags(default=False)
  app.run(main)
