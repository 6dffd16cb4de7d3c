"""Kimi-K2 on paper: the slice's measured forwards extrapolated to 61 layers and to 8 GPUs.

Reads `bench_moe --shape=kimi-k2-slice --sections=verify --verify_layers=4,2` rows (the slice's
first 4 layers, 1 dense + 3 MoE, and its first 2): one MoE layer's cost at T tokens is half the
difference of the two forwards, the rest of the 2-layer forward (embedding, the dense layer, the
lm_head, one MoE layer's worth taken out) is the fixed part. Then, per step of T tokens:

  one device  fixed + 60 MoE layers (Kimi-K2: 61 layers, the first dense), as if it fit
  8 GPUs      per MoE layer the expert reads of the busiest device (the layer's d distinct
              experts over 8 devices of 48, drawn at random: the expected largest share of d),
              every other read split 8 ways, plus --allreduce_us per all-reduce, 2 per layer

The expert / other split of a layer's time is its floor's split (bytes at the bandwidth the rows'
floors were drawn at: their bandwidth row, else --bandwidth) scaled by the measured time over that
floor; x spec is that time over the floor at the card's spec bandwidth (the bandwidth row's).
With an assumed acceptance curve (--tau: tokens per round by budget, the DDTree paper's Qwen3-8B
MATH-500 curve by default), tokens per ms follow.

  python -m experiments.perf.kimi_paper --rows=experiments/results/mla-2026-12-02/kimi.jsonl
"""

import json

from absl import app, flags
import numpy as np

from experiments.perf import floors

flags.DEFINE_string("rows", None, "bench_moe JSON lines of the Kimi-K2 slice (verify section)")
flags.DEFINE_integer("moe_layers", 60, "MoE layers of the whole model (Kimi-K2: 60 of 61)")
flags.DEFINE_integer("experts", 384, "routed experts per layer")
flags.DEFINE_integer("devices", 8, "GPUs, experts split evenly over them")
flags.DEFINE_float("allreduce_us", 37.5, "one all-reduce of a layer's output (measured 35-40 us "
                   "at tp=2 on H200s: docs/findings/tensor-parallelism.md)")
flags.DEFINE_integer("all_reduces", 2, "all-reduces per layer (attention output, MoE output)")
flags.DEFINE_float("expert_mb", 88.08, "bytes of one expert (3 x 7168 x 2048 bf16), MB")
flags.DEFINE_float("bandwidth", 4.3e12, "the floors' bytes per second where the rows have no "
                   "bandwidth row (bench_moe before floors.measure: its --floor_bandwidth "
                   "default then)")
flags.DEFINE_string("tau", "1:1,9:6.5,17:8.6,33:9.25,65:9.75", "assumed tokens per round by "
                    "verify size T (budget + 1): AR 1; DDTree paper Fig. 3, Qwen3-8B MATH-500")
FLAGS = flags.FLAGS


def busiest_share(d: int, experts: int, devices: int, draws: int = 4000, seed: int = 0) -> float:
  """Expected largest number of d distinct random experts held by one of `devices` devices."""
  rng = np.random.default_rng(seed)
  per = experts // devices
  counts = [np.bincount(rng.choice(experts, d, replace=False) // per, minlength=devices).max()
            for _ in range(draws)]
  return float(np.mean(counts))


def main(_):
  rows = [json.loads(line) for line in open(FLAGS.rows) if line.strip()]
  by = {(r["layers"], r["tokens"]): r for r in rows if r.get("section") == "verify"}
  tau = {int(k): float(v) for k, v in (p.split(":") for p in FLAGS.tau.split(","))}
  given = next((r for r in rows if r.get("section") == "bandwidth"), None)
  bw = given["bandwidth_GBps"] * 1e9 if given else FLAGS.bandwidth
  spec = (given or {}).get("spec_GBps")  # GB/s; None where unknown
  print(f"floors at {bw / 1e9:.0f} GB/s, "
        + ("the rows' bandwidth row" if given else "--bandwidth (the rows have no bandwidth row)")
        + f"; spec {'unknown' if spec is None else f'{spec:.0f} GB/s'}")
  out, ar = [], None
  for t in sorted({t for _, t in by}):
    four, two = by.get((4, t)), by.get((2, t))
    if four is None or two is None:
      continue
    layer_ms = (four["ms"] - two["ms"]) / 2
    layer_floor = (four["floor_ms"] - two["floor_ms"]) / 2
    d = (3 * four["distinct_per_layer"] - two["distinct_per_layer"]) / 2  # layers 2 and 3
    expert_floor = d * FLAGS.expert_mb * 1e6 / bw * 1e3
    scale = layer_ms / layer_floor
    experts_ms, other_ms = expert_floor * scale, (layer_floor - expert_floor) * scale
    fixed = two["ms"] - layer_ms
    one = fixed + FLAGS.moe_layers * layer_ms
    share = busiest_share(round(d), FLAGS.experts, FLAGS.devices)
    comm = FLAGS.all_reduces * FLAGS.allreduce_us / 1e3
    per_dev = other_ms / FLAGS.devices + experts_ms * share / d + comm
    eight = fixed / FLAGS.devices + comm + FLAGS.moe_layers * per_dev
    ar = ar or (one, eight)
    x_spec = {"ratio_to_spec_floor": None if spec is None else scale * spec * 1e9 / bw}
    out.append((t, d, layer_ms, scale, x_spec, one, one / ar[0], share, eight, eight / ar[1],
                tau.get(t)))
  print(f"{'T':>4}{'experts':>9}{'layer ms':>10}{'x floor':>9}{'x spec':>8}{'1 GPU ms':>10}"
        f"{'x AR':>7}{'busiest':>9}{'8 GPUs ms':>11}{'x AR':>7}{'tau':>6}{'tok/ms 1':>10}"
        f"{'tok/ms 8':>10}")
  for t, d, lm, sc, xs, one, r1, share, eight, r8, tu in out:
    tpm = lambda ms: f"{tu / ms:>10.3f}" if tu else f"{'-':>10}"
    print(f"{t:>4}{d:>9.1f}{lm:>10.3f}{sc:>9.2f}{floors.x_spec(xs)}{one:>10.2f}{r1:>7.2f}"
          f"{share:>9.1f}{eight:>11.2f}{r8:>7.2f}{tu or '-':>6}{tpm(one)}{tpm(eight)}")
  floors.check(rows)  # a projection from rows under their floors would rest on a measuring bug


if __name__ == "__main__":
  flags.mark_flag_as_required("rows")
  app.run(main)
