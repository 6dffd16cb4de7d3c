"""One GPU's share of Kimi K2.6 as deployed on 8 H200s, measured, then the deployment on paper.

  python -m experiments.perf.bench_kimi_share           # one H200: 20 programs, both tables
  python -m experiments.perf.bench_kimi_share --small   # tiny shapes on CPU, interpret mode (smoke)

The deployment: Kimi K2.6 (DeepSeek-V3 architecture: 61 layers, the first dense; hidden 7168; 64
latent-attention heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; 384 routed experts
top-8 + 1 shared of width 2048, dense MLP 18432; vocab 163840; routed experts int4 as shipped,
compressed-tensors groups of 32) on 8 GPUs, its experts split 8 ways. Every GPU holds all the
attention, the shared experts, the dense layer, the embedding and lm_head (bf16) and 48 of each
layer's 384 experts (int4): ~95 GB by this script's count (it prints it), one H200, and the 7 GB
drafter, replicated too. Every GPU runs the attention for all rows; after a MoE layer's experts
one all-reduce (psum) of [rows, 7168] bf16 sums the 8 GPUs' partial outputs.

Part 1, measured on one GPU: that share with random weights in the real formats
(`decoder.init_params(..., experts="int4", held_experts=48)`: the router picks among all 384, the
pairs routed to the other 336 count as held elsewhere and are skipped) and a 6-layer DFlash
drafter of the target's width (z-lab's Kimi-K2.5-DFlash shape: hidden 7168, 64 / 8 heads of 128,
MLP 18432, block 16, tapping 6 target layers), prefix --prefix. Each row is the real decode loop
(`harness.Case`, lax.while_loop, --steps steps a call, the median of --repeats calls over its
steps, so a call's fixed cost is spread over --steps) of AR or DDTree at budget B, at each batch,
with the engine's kernels (`Kernels(--attention)`: on pallas the int4 expert GEMMs go wherever
`pallas.grouped_gemm` sends a quantized stack). Per row:

  experts  distinct experts of THIS GPU's 48 that a layer's rows touch, two ways: `router`, the
           model's own routers on random unit-RMS rows (the step's row count: batch x (B + 1),
           the mean over MoE layers and 16 draws; random routers concentrate somewhat), which the
           bytes use; `uniform`, the expectation if every row picked 8 of 384 uniformly:
           48 * (1 - (1 - 8/384)^rows)
  bytes    what the step must read once: the target's weights but its routed experts and its
           embedding table (attention, shared experts, dense layer, routers, norms, lm_head),
           the touched experts' int4 words and scales, the embedding rows looked up, the latent
           KV prefix; DDTree also the drafter's weights, the lm_head a second time (the draft's
           logits, a separate pass) and the drafter's KV prefix
  floor    the bytes at the floors' bandwidth (`floors.measure`: the best of this run's read
           and copy probes, or --floor_bandwidth given); x spec: at the card's spec bandwidth

Compiling 61 unrolled layers is slow, so each row is measured at every --layers count (default 4
and 8: the dense layer and 3 or 7 MoE layers, the same arrays cut) and fitted per row as step =
a + b * layers (least squares); the 61-layer step is a + 61 b, its bytes likewise counted at 61.

Part 2, on paper: the 8-GPU deployment's step = the fitted 61-layer share's step + 60 MoE layers x
--collectives_per_layer all-reduces of [rows, 7168] bf16, each --collective_latency_us plus
2 (g - 1) / g x its bytes over --allreduce_busbw_GBps (NCCL's bus bandwidth of a ring all-reduce)
+ the experts the busiest GPU reads beyond this GPU's mean (uniform routing, at the floor's
bandwidth: a step waits for its slowest GPU). The drafter, lm_head and KV cache stay replicated as
measured. Tokens per second = batch x tau / step, tau the tokens a step commits per sequence
(the bonus included): AR 1; --tau as given (a range lo-hi gives both ends); --tau_assumed,
budgets whose acceptance is assumed (marked *). The table names the winning budget per batch.
"""

import concurrent.futures
import dataclasses
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine
from ddtree_jax.kernels import Kernels
from ddtree_jax.models import decoder, moe
from ddtree_jax.speculative import decode
from experiments.perf import common_flags, floors, harness

common_flags.define("small", "prefix", "json_out", "floor_bandwidth", compile_threads=10,
                    repeats=3)
flags.DEFINE_string("layers", "4,8", "target layer counts measured (>= 2 of them; the step "
                    "is fitted as a + b * layers and extrapolated to --model_layers)")
flags.DEFINE_integer("held_experts", 48, "routed experts per layer on this GPU (of 384)")
flags.DEFINE_enum("experts_format", "int4", ["int4", "fp8", "float"], "the routed experts' "
                  "format (int4: compressed-tensors W4A16 as Kimi K2.6 ships; fp8: DeepSeek-V3's "
                  "blocks; float: bf16)")
flags.DEFINE_enum("attention", "pallas", ["pallas", "xla"], "Kernels.attention: the engine's "
                  "Pallas kernels (interpret mode on a CPU) or XLA's")
flags.DEFINE_string("runs", "ar,8,16,32,64", "comma list: ar or a DDTree budget")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_integer("steps", 16, "decode steps a timed call runs")
flags.DEFINE_integer("draft_layers", 6, "drafter layers (z-lab Kimi-K2.5-DFlash: 6)")
flags.DEFINE_integer("draft_kv_heads", 8, "drafter kv heads of 128 (64 query heads)")
flags.DEFINE_integer("draft_taps", 6, "target layers the drafter taps (its fc reads taps x 7168)")
flags.DEFINE_integer("model_layers", harness.KIMI_LAYERS, "the whole model's layers")
flags.DEFINE_integer("gpus", 8, "GPUs of the deployment (experts split evenly)")
flags.DEFINE_float("allreduce_busbw_GBps", 450.0, "assumed NVLink all-reduce bus bandwidth per "
                   "GPU (NCCL's busbw; H200 NVLink 4: 450 GB/s a direction)")
flags.DEFINE_float("collective_latency_us", 15.0, "assumed fixed cost of one all-reduce (launch "
                   "and NVLink latency of a small message, 10-20 us; this project's tp=2 "
                   "all-reduces read 35-40 us with CUDA graphs off: "
                   "docs/findings/tensor-parallelism.md)")
flags.DEFINE_integer("collectives_per_layer", 1, "all-reduces per MoE layer (attention "
                     "replicated: one psum after the routed experts)")
flags.DEFINE_string("tau", "8:4.48,16:5.3-6.4", "given tokens per step per sequence (bonus "
                    "included) by budget, 'B:tau' or 'B:lo-hi'; AR is 1")
flags.DEFINE_string("tau_assumed", "32:6.8,64:7.2", "assumed tokens per step (no measurement: "
                    "a modest extrapolation), marked * in the table")
engine.define_compilation_cache_flags()
FLAGS = flags.FLAGS

# --small: flags left at their defaults take these (a few seconds' worth of programs on a CPU;
# medians of 3 calls: one call's outlier would send a fitted 61-layer step under its floor)
SMALL = dict(layers="2,3", runs="ar,8", batches="1,2", steps=4, repeats=3, draft_layers=2)
# --small's XLA: the CPU compiler at its lowest optimization (the smoke run's time is its
# compiles, and its timings mean nothing anyway)
SMALL_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
ROWS = []


def emit(row):
  ROWS.append(row)
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def parse_tau(text: str, assumed: bool) -> dict:
  """'8:4.48,16:5.3-6.4' -> {8: (4.48, 4.48, assumed), 16: (5.3, 6.4, assumed)}."""
  out = {}
  for item in (x for x in text.split(",") if x):
    budget, _, value = item.partition(":")
    lo, _, hi = value.partition("-")
    try:
      out[int(budget)] = (float(lo), float(hi or lo), assumed)
    except ValueError:
      raise app.UsageError(f"--tau / --tau_assumed take B:tau or B:lo-hi, got {item!r}") from None
  return out


def first_layers(params, cfg, n: int):
  """(params, cfg) of the target's first n layers (the same arrays)."""
  return (dataclasses.replace(params, layers=params.layers[:n]),
          dataclasses.replace(cfg, num_layers=n,
                              moe_layers=tuple(l for l in cfg.moe_layers if l < n)))


def routed_experts(tp, cfg, rows: int, held: int, draws: int = 16) -> float:
  """Mean distinct experts among the first `held` that each MoE layer's own router picks for
  `rows` random unit-RMS rows (what this GPU reads; the mean over layers and draws)."""
  routers = [(l.moe.router, l.moe.bias) for l in tp.layers if l.moe is not None]

  @jax.jit
  def count(routers, key):
    out = []
    for i, (router, bias) in enumerate(routers):
      x = jax.random.normal(jax.random.fold_in(key, i), (draws, rows, cfg.hidden_size),
                            jnp.bfloat16)
      params = moe.MoEParams(router=router, w_gate_up=None, w_down=None, bias=bias)
      _, chosen = jax.vmap(lambda r: moe.route(params, r, cfg.routing))(x)  # [draws, rows, k]
      hit = jax.vmap(lambda c: jnp.zeros((cfg.num_experts,), bool).at[c.reshape(-1)].set(True))(
          chosen)
      out.append(jnp.sum(hit[:, :held], axis=1))
    return jnp.stack(out)
  return float(np.mean(np.asarray(count(routers, jax.random.key(rows)))))


def uniform_experts(rows: int, experts: int, top_k: int, held: int) -> float:
  """The expected distinct experts of `held` touched by `rows` rows picking top_k of `experts`
  uniformly at random."""
  return held * (1 - (1 - top_k / experts) ** rows)


def busiest_excess(rows: int, experts: int, top_k: int, gpus: int, draws: int = 64) -> float:
  """Uniform routing of `rows` rows, experts split evenly over `gpus`: the expected distinct
  experts of the busiest GPU minus those of the mean GPU (what the slowest GPU reads extra)."""
  rng = np.random.default_rng(rows)
  per, excess = experts // gpus, []
  for _ in range(draws):
    picked = np.argpartition(rng.random((rows, experts)), top_k, axis=1)[:, :top_k]
    hit = np.zeros(experts, bool)
    hit[picked.reshape(-1)] = True
    counts = hit[:per * gpus].reshape(gpus, per).sum(axis=1)
    excess.append(counts.max() - counts.mean())
  return float(np.mean(excess))


@dataclasses.dataclass(frozen=True)
class Bytes:
  """What one step of the share reads, split so that it can be counted at any layer count."""
  fixed_target: int      # the dense layer, the final norm, the lm_head (one pass)
  moe_layer: int         # one MoE layer's attention, shared expert, router, norms
  expert: int            # one routed expert's stored bytes (int4: words + scales)
  embed_row: int         # one embedding row
  kv_row: int            # one token's latent KV row of one layer
  lm_head: int
  drafter: int           # the drafter's weights (its fc, layers, norms)
  draft_kv_row: int      # one token's drafter K/V row over all its layers
  block: int             # the drafter's block (tokens it embeds)

  def step(self, layers: int, rows_per_seq: int, batch: int, prefix: int, experts: float,
           spec: bool) -> float:
    """Bytes of a step over `layers` target layers (the first dense), `experts` distinct
    experts per MoE layer."""
    moe_layers = layers - 1
    out = (self.fixed_target + moe_layers * (self.moe_layer + experts * self.expert)
           + batch * rows_per_seq * self.embed_row + layers * batch * prefix * self.kv_row)
    if spec:
      out += (self.drafter + self.lm_head + batch * prefix * self.draft_kv_row
              + batch * self.block * self.embed_row)
    return float(out)


def byte_counts(tp, cfg, dp, dcfg, held: int) -> Bytes:
  """The share's bytes by part, from its arrays (tp: a target of >= 2 layers, the first dense)."""
  layer = tp.layers[1]
  routed = decoder.param_bytes(layer.moe.w_gate_up) + decoder.param_bytes(layer.moe.w_down)
  moe_layer = decoder.param_bytes(layer) - routed
  experts = sum(decoder.param_bytes(l.moe.w_gate_up) + decoder.param_bytes(l.moe.w_down)
                for l in tp.layers if l.moe is not None)
  other_layers = sum(decoder.param_bytes(l) for l in tp.layers[1:]) - experts
  fixed = decoder.param_bytes(tp) - experts - decoder.param_bytes(tp.embed) - other_layers
  heads, k_dim, v_dim = cfg.cache_layout
  dl = dcfg.layers
  return Bytes(fixed_target=fixed, moe_layer=moe_layer, expert=routed // held,
               embed_row=cfg.hidden_size * tp.embed.dtype.itemsize,
               kv_row=heads * (k_dim + v_dim) * 2, lm_head=decoder.param_bytes(tp.lm_head),
               drafter=decoder.param_bytes(dp),
               draft_kv_row=dl.num_layers * dl.num_kv_heads * 2 * dl.head_dim * 2,
               block=dcfg.block_size)


def compile_rows(rows, threads: int):
  """Compiles every row's case, `threads` at a time; a row whose compile fails keeps its error
  (a missing kernel for one format or size costs that row, not the run)."""
  def one(row):
    try:
      loop, _, secs = row["case"].compile()
      return loop, secs, None
    except Exception as err:  # pylint: disable=broad-except
      return None, 0.0, f"{type(err).__name__}: {str(err)[:300]}"
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
    out = list(ex.map(one, rows))
  print(f"compiled {len(rows)} programs in {time.perf_counter() - t0:.1f} s ({threads} "
        "threads)", flush=True)
  return out


def main(_):
  t_start = time.perf_counter()
  if FLAGS.small and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # (read when the backend starts: nothing before this line has touched a device)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SMALL_XLA_FLAGS}".strip()
  args = common_flags.start()
  small = args.small
  if small:  # tiny defaults for the flags left alone
    for name, value in SMALL.items():
      if not FLAGS[name].present:
        setattr(args, name, value)
  counts = sorted(set(harness.ints(args.layers)))
  if len(counts) < 2 or counts[0] < 2:
    raise app.UsageError(f"--layers needs two or more counts >= 2, got {args.layers!r}")
  runs = [0 if r == "ar" else int(r) for r in args.runs.split(",") if r]
  batches = harness.ints(args.batches)
  tau = {**parse_tau(args.tau_assumed, True), **parse_tau(args.tau, False)}

  cfg = harness.target_config(small, "kimi-k2.6", layers=counts[-1])
  held = cfg.num_experts // 8 if small else args.held_experts
  if held * args.gpus != cfg.num_experts:
    print(f"note: {held} experts held x {args.gpus} GPUs is not the {cfg.num_experts} routed: "
          "the paper table still splits them evenly over --gpus", flush=True)
  # drawn in one program each (op by op, every weight shape would compile its own)
  tp = jax.jit(lambda k: harness.random_target(cfg, k, experts=args.experts_format,
                                               held_experts=held))(jax.random.key(0))
  # the drafter taps layers every measured count has, so it is the same program part at each
  dcfg = harness.drafter_config(harness.target_config(small, "kimi-k2.6", layers=counts[0]),
                                small, layers=args.draft_layers,
                                kv_heads=None if small else args.draft_kv_heads,
                                taps=args.draft_taps)
  dp = jax.jit(lambda k: harness.random_drafter_params(cfg, dcfg, k))(jax.random.key(1))
  parts = byte_counts(tp, cfg, dp, dcfg, held)
  whole = (parts.fixed_target + decoder.param_bytes(tp.embed)
           + (args.model_layers - 1) * (parts.moe_layer + held * parts.expert))
  print(f"devices {jax.devices()}  share at {counts[-1]} layers "
        f"{decoder.param_bytes(tp) / 1e9:.2f} GB ({args.experts_format} experts, {held} of "
        f"{cfg.num_experts} held; one expert {parts.expert / 1e6:.2f} MB), at "
        f"{args.model_layers} layers {whole / 1e9:.1f} GB; drafter {parts.drafter / 1e9:.2f} GB "
        f"({dcfg.layers.num_layers} layers, taps {dcfg.target_layer_ids})", flush=True)
  bw = floors.measure(small, args.floor_bandwidth)
  print(bw.describe(), flush=True)
  emit(bw.row())

  kern = Kernels(args.attention)
  routed = {}  # rows -> this GPU's experts per MoE layer (by every measured layer's router)
  for b in batches:  # per batch every program compiled first (in threads), then each timed alone
    rows = []
    for n in counts:
      p, c = first_layers(tp, cfg, n)
      for budget in runs:
        method = "ddtree" if budget else "ar"
        lc = decode.LoopConfig(kernels=kern, method=method, max_new_tokens=args.steps + 1,
                               num_drafts=dcfg.num_drafts if budget else 0, budget=budget)
        d = (dp, dcfg) if budget else (None, None)
        rows.append({"layers": n, "budget": budget, "batch": b,
                     "case": harness.Case.make(p, c, d[0], d[1], lc, b, args.prefix)})
    for row, (loop, secs, err) in zip(rows, compile_rows(rows, args.compile_threads)):
      case = row.pop("case")
      n, budget = row["layers"], row["budget"]
      t = budget + 1 if budget else 1
      row.update(section="share", run=f"B={budget}" if budget else "ar", rows=b * t,
                 attention=args.attention, experts_format=args.experts_format, held=held)
      if err:
        emit({**row, "error": err})
        continue
      s = harness.step_seconds(loop, case, args.repeats)
      if b * t not in routed:
        routed[b * t] = routed_experts(tp, cfg, b * t, held)
      nbytes = parts.step(n, t, b, args.prefix, routed[b * t], bool(budget))
      row.update(step_ms=s * 1e3, experts_router=routed[b * t],
                 experts_uniform=uniform_experts(b * t, cfg.num_experts,
                                                 cfg.num_experts_per_tok, held),
                 bytes_GB=nbytes / 1e9, compile_s=secs)
      emit(floors.mark(row, s * 1e3, nbytes, bw))
    print(f"batch {b} done at {time.perf_counter() - t_start:.0f} s", flush=True)

  fits = fit_rows(counts, parts, args, bw)
  paper_rows(fits, cfg, args, bw, parts, tau)
  print_tables(counts, args, bw, cfg.hidden_size)
  print(f"\nwall {time.perf_counter() - t_start:.0f} s", flush=True)
  floors.check(ROWS)


def fit_rows(counts, parts, args, bw):
  """Per (run, batch) measured at every layer count: step = a + b * layers, and its value and
  bytes at --model_layers."""
  fits = []
  for b in harness.ints(args.batches):
    for budget in (0 if r == "ar" else int(r) for r in args.runs.split(",") if r):
      got = {r["layers"]: r for r in ROWS if r.get("section") == "share"
             and r["batch"] == b and r["budget"] == budget and "step_ms" in r}
      if set(got) != set(counts):
        continue
      per_layer, a = np.polyfit(counts, [got[n]["step_ms"] for n in counts], 1)
      n, last = args.model_layers, got[counts[-1]]
      t = last["rows"] // b
      experts = float(np.mean([got[k]["experts_router"] for k in counts]))
      nbytes = parts.step(n, t, b, args.prefix, experts, bool(budget))
      step = a + per_layer * n
      row = {"section": "fit", "run": last["run"], "budget": budget, "batch": b,
             "rows": last["rows"], "a_ms": a, "per_layer_ms": per_layer, "layers": n,
             "step_ms": step, "experts_router": experts, "bytes_GB": nbytes / 1e9}
      emit(floors.mark(row, step, nbytes, bw))
      fits.append(row)
  return fits


def paper_rows(fits, cfg, args, bw, parts, tau):
  """The 8-GPU deployment's step from each fitted share row, and its tokens per second."""
  g, h = args.gpus, cfg.hidden_size
  moe_layers = args.model_layers - 1
  for f in fits:
    rows, b, budget = f["rows"], f["batch"], f["budget"]
    message = rows * h * 2  # [rows, H] bf16
    one = (args.collective_latency_us * 1e-6
           + 2 * (g - 1) / g * message / (args.allreduce_busbw_GBps * 1e9))
    comm_ms = moe_layers * args.collectives_per_layer * one * 1e3
    excess = busiest_excess(rows, cfg.num_experts, cfg.num_experts_per_tok, g)
    busiest_ms = moe_layers * bw.floor_ms(excess * parts.expert)
    step = f["step_ms"] + comm_ms + busiest_ms
    lo, hi, assumed = (1.0, 1.0, False) if budget == 0 else tau.get(budget, (None, None, True))
    row = {"section": "paper", "run": f["run"], "budget": budget, "batch": b, "rows": rows,
           "share_ms": f["step_ms"], "comm_ms": comm_ms, "busiest_ms": busiest_ms,
           "step_ms": step, "tau_lo": lo, "tau_hi": hi, "tau_assumed": assumed}
    if lo is not None:
      row.update(tok_s_lo=b * lo / step * 1e3, tok_s_hi=b * hi / step * 1e3)
    emit(row)


def print_tables(counts, args, bw, hidden):
  print(f"\n== One GPU's share of Kimi K2.6 ({args.experts_format} experts), measured: decode "
        f"step (median) vs the bytes it reads at {bw.bytes_per_s / 1e9:.0f} GB/s; {args.attention} "
        f"kernels, prefix {args.prefix}, {args.steps} steps a call")
  print("experts: distinct of this GPU's experts per MoE layer, by the model's routers on random "
        "rows (bytes use these) | the uniform-routing expectation")
  print(f"{'layers':>6} {'run':<6}{'batch':>6}{'rows':>6}{'step ms':>10}{'router':>8}"
        f"{'uniform':>8}{'GB':>8}{'floor ms':>10}{'x floor':>8}{'x spec':>8}{'compile s':>10}")
  for r in ROWS:
    if r["section"] != "share":
      continue
    head = f"{r['layers']:>6} {r['run']:<6}{r['batch']:>6}{r['rows']:>6}"
    if "error" in r:
      print(f"{head}  failed: {r['error'][:70]}")
      continue
    print(f"{head}{r['step_ms']:>10.3f}{r['experts_router']:>8.1f}{r['experts_uniform']:>8.1f}"
          f"{r['bytes_GB']:>8.2f}{r['floor_ms']:>10.3f}{r['ratio_to_floor']:>8.2f}"
          f"{floors.x_spec(r)}{r['compile_s']:>10.1f}{floors.flag(r)}")
  fits = [r for r in ROWS if r["section"] == "fit"]
  n = args.model_layers
  print(f"\n== The share at {n} layers, extrapolated: each row fitted as step = a + b * layers "
        f"over layers {','.join(map(str, counts))} (measured, not {n} compiled), bytes counted "
        f"at {n}")
  print(f"{'run':<6}{'batch':>6}{'rows':>6}{'a ms':>9}{'b ms/layer':>12}{f'{n}-layer ms':>13}"
        f"{'GB':>8}{'floor ms':>10}{'x floor':>8}{'x spec':>8}")
  for r in fits:
    print(f"{r['run']:<6}{r['batch']:>6}{r['rows']:>6}{r['a_ms']:>9.3f}{r['per_layer_ms']:>12.3f}"
          f"{r['step_ms']:>13.2f}{r['bytes_GB']:>8.2f}{r['floor_ms']:>10.2f}"
          f"{r['ratio_to_floor']:>8.2f}{floors.x_spec(r)}{floors.flag(r)}"
          + ("  (slope <= 0: noise; raise --steps, --repeats)" if r["per_layer_ms"] <= 0 else ""))
  paper = [r for r in ROWS if r["section"] == "paper"]
  print(f"\n== On paper: Kimi K2.6 on {args.gpus} GPUs, experts split {args.gpus} ways, attention "
        "replicated")
  print(f"step = the {n}-layer share + {n - 1} MoE layers x {args.collectives_per_layer} "
        f"all-reduce of [rows, {hidden}] bf16 (assumed {args.collective_latency_us:g} us + bytes "
        f"x 2(g-1)/g at {args.allreduce_busbw_GBps:g} GB/s bus bandwidth)\n     + the busiest "
        "GPU's extra experts (uniform routing, at the floor's bandwidth)")
  print("tau: tokens a step commits per sequence, bonus included (AR 1; * = assumed, not "
        "measured); tok/s = batch x tau / step")
  print(f"{'run':<6}{'batch':>6}{'rows':>6}{'share ms':>10}{'comm ms':>9}{'busiest':>9}"
        f"{'step ms':>9}{'tau':>11}{'tok/s':>15}{'x AR':>12}")
  ar = {r["batch"]: r for r in paper if r["budget"] == 0}
  for r in paper:
    tau_txt = ("-" if r["tau_lo"] is None else fmt_range(r["tau_lo"], r["tau_hi"], "{:.2f}")
               + ("*" if r["tau_assumed"] else ""))
    tok = fmt_range(r["tok_s_lo"], r["tok_s_hi"], "{:.0f}") if "tok_s_lo" in r else "-"
    base = ar.get(r["batch"])
    speed = (fmt_range(r["tok_s_lo"] / base["tok_s_lo"], r["tok_s_hi"] / base["tok_s_lo"],
                       "{:.2f}") if base and "tok_s_lo" in r else "-")
    print(f"{r['run']:<6}{r['batch']:>6}{r['rows']:>6}{r['share_ms']:>10.2f}{r['comm_ms']:>9.2f}"
          f"{r['busiest_ms']:>9.2f}{r['step_ms']:>9.2f}{tau_txt:>11}{tok:>15}{speed:>12}")
  for b in sorted({r["batch"] for r in paper}):
    winners(b, [r for r in paper if r["batch"] == b and "tok_s_lo" in r])


def fmt_range(lo, hi, spec):
  return spec.format(lo) if abs(hi - lo) < 1e-9 else f"{spec.format(lo)}-{spec.format(hi)}"


def winners(b, rows):
  """Prints the budget with the most tokens per second at this batch (by each row's middle
  tau), by how much it beats the next one and AR, and whether the ends of the tau ranges
  change the winner."""
  if not rows:
    return
  mid = lambda r: (r["tok_s_lo"] + r["tok_s_hi"]) / 2
  ranked = sorted(rows, key=mid, reverse=True)
  best = ranked[0]
  line = f"batch {b}: {best['run']} wins, {mid(best):.0f} tok/s"
  if len(ranked) > 1:
    line += (f", {mid(best) / mid(ranked[1]):.2f}x the next ({ranked[1]['run']} "
             f"{mid(ranked[1]):.0f})")
  ar = next((r for r in rows if r["budget"] == 0), None)
  if ar is not None and ar is not best:
    line += f", {mid(best) / mid(ar):.2f}x AR"
  if best["tau_assumed"]:
    line += " (its tau assumed)"
  for end in ("tok_s_lo", "tok_s_hi"):
    other = max(rows, key=lambda r, e=end: r[e])
    if other is not best:
      line += (f"; with every tau at its {'low' if end == 'tok_s_lo' else 'high'} end "
               f"{other['run']} wins ({other[end]:.0f} tok/s)")
  print(line)


if __name__ == "__main__":
  app.run(main)
