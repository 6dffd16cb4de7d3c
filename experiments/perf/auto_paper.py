"""budget="auto"'s choices under simulated acceptance: the chooser of `speculative/auto.py` (its
`decide`, back-off and per-row ratio, as the decode loop runs them) fed measured step times and
accepted lengths drawn from an assumed per-budget acceptance curve, against every fixed budget
on the same draws.

Random weights accept nothing, so for the Qwen3-8B, Qwen3-30B-A3B and Moonlight shapes the
acceptance is simulated. Per step and row a difficulty X ~ Gamma(k, 1/k) (mean 1) is drawn; budget
B accepts round(a(B) X) drafts (stochastic rounding, at most --depth), a(B) = tau(B) - 1 from
--tau (the DDTree paper's Qwen3-8B MATH-500 curve by default), so a bigger tree never accepts
less on the same step. The draft's own expectation, what the chooser sees, is m d(B) X^rho: d(B)
from --draft_tau (default --tau: the draft knows the curve's shape), m (--calibration) under- or
over-states it, rho how much the draft knows about the step. A constant m the chooser's per-row
ratio learns away; a --draft_tau flatter than --tau (drafts that understate what bigger trees
add) it cannot. Costs
(--costs, ms per step by budget, 0 = AR) are measured H200 steps; the chooser's own overhead is
not modelled. Each row emits --tokens tokens; a batch runs until its last row is done.

  python -m experiments.perf.auto_paper \
      --costs=0:4.476,16:5.453,32:5.697,64:6.134,128:7.056 --batch=1
"""

import collections

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from ddtree_jax.speculative import auto as auto_lib

flags.DEFINE_string("costs", "0:4.476,16:5.453,32:5.697,64:6.134,128:7.056",
                    "ms per step by budget (0: AR), the auto options")
flags.DEFINE_string("tau", "8:6.5,16:8.6,32:9.25,64:9.75,128:10.2,1024:11.0",
                    "assumed tokens per round by budget (DDTree paper Fig. 3, Qwen3-8B MATH-500; "
                    "8: assumed)")
flags.DEFINE_string("draft_tau", "", "the curve the draft's own expectation follows ('' = --tau)")
flags.DEFINE_integer("batch", 1, "rows")
flags.DEFINE_integer("tokens", 256, "tokens each row emits")
flags.DEFINE_integer("depth", 16, "the most drafts a step can accept (the block size)")
flags.DEFINE_string("calibration", "0.5,1,2", "m: the draft's expectation over the truth")
flags.DEFINE_float("rho", 0.5, "the draft's expectation follows the step's difficulty as X^rho")
flags.DEFINE_float("shape_k", 2.0, "Gamma shape of the per-step difficulty")
flags.DEFINE_integer("seeds", 5, "draws per cell (tokens/s summed over them)")
FLAGS = flags.FLAGS


def pairs(text: str, what: str) -> dict[int, float]:
  try:
    out = {int(k): float(v) for k, v in (p.split(":") for p in text.split(",") if p.strip())}
  except ValueError as e:
    raise app.UsageError(f"--{what}: budget:value pairs, e.g. 0:4.5,16:5.4 ({e})") from e
  if not out:
    raise app.UsageError(f"--{what} is empty")
  return out


def mean_accepted(tau: dict[int, float], budgets) -> np.ndarray:
  """a(B) = tau(B) - 1 at each budget, interpolated in log2(B) (AR: 0)."""
  known = sorted(tau)
  x = np.log2(known)
  return np.asarray([0.0 if b == 0 else np.interp(np.log2(b), x, [tau[k] - 1 for k in known])
                     for b in budgets])


def draws(rng, batch: int, steps: int, a, depth: int, k: float):
  """X [steps, batch] and accepted [steps, batch, J]: round(a_j X), stochastic, capped."""
  x = rng.gamma(k, 1.0 / k, size=(steps, batch))
  u = rng.random((steps, batch))
  acc = np.minimum(np.floor(a[None, None, :] * x[..., None] + u[..., None]), depth)
  return x, acc.astype(np.int32)


def run_fixed(j, acc, batch: int, tokens: int, cost):
  """Seconds for every row to emit `tokens` at option j (ms units)."""
  left, t, step = np.full(batch, tokens), 0.0, 0
  while (left > 0).any():
    left = left - np.where(left > 0, 1 + acc[step, :, j], 0)
    t += cost[j]
    step += 1
  return t


def run_auto(budgets, cost, x, acc, d, m: float, rho: float, tokens: int):
  """Seconds and the chosen budgets of the chooser over the same draws."""
  batch = x.shape[1]
  has_ar = int(budgets[0] == 0)
  drafted = len(budgets) - has_ar
  auto = auto_lib.AutoState.init(jnp.asarray(cost), batch, x.shape[0], drafted)
  left, t, chosen = np.full(batch, tokens), 0.0, collections.Counter()
  for step in range(x.shape[0]):
    live = left > 0
    if not live.any():
      break
    if int(auto.skip) > 0:
      j, got, predicted, back_off, tier = 0, np.zeros(batch, np.int32), np.zeros(batch), False, None
    else:
      tier = int(auto.tier)
      n = has_ar + tier + 1
      expected = m * d[None, :n] * (x[step][:, None] ** rho)
      i, back_off, tier = auto_lib.decide(auto, jnp.asarray(expected, jnp.float32),
                                          jnp.asarray(live), tier, has_ar, drafted)
      j = has_ar + int(i)
      got, predicted = acc[step, :, j], expected[:, j]
    left = left - np.where(live, 1 + got, 0)
    t += cost[j]
    chosen[budgets[j]] += 1
    auto = auto_lib.after_step(auto, step, jnp.int32(budgets[j]),
                               jnp.asarray(predicted, jnp.float32), jnp.asarray(got),
                               jnp.asarray(live), back_off, tier)
  return t, chosen


def main(_):
  costs, tau = pairs(FLAGS.costs, "costs"), pairs(FLAGS.tau, "tau")
  budgets = sorted(costs)
  cost = np.asarray([costs[b] for b in budgets])
  a = mean_accepted(tau, budgets)
  d = mean_accepted(pairs(FLAGS.draft_tau, "draft_tau") if FLAGS.draft_tau else tau, budgets)
  steps = FLAGS.tokens + 1                                # enough for AR, the slowest
  names = ["AR" if b == 0 else f"B={b}" for b in budgets]
  print(f"batch {FLAGS.batch}, {FLAGS.tokens} tokens a row, {FLAGS.seeds} draws; options "
        + ", ".join(f"{n} {c:.3f} ms (a {x:.2f}, d {y:.2f})"
                    for n, c, x, y in zip(names, cost, a, d)))
  print(f"{'m':>5} " + "".join(f"{n:>9}" for n in names)
        + f"{'auto':>9}{'/ best':>8}{'/ worst':>8}  auto's steps by budget")
  for m in (float(v) for v in FLAGS.calibration.split(",")):
    fixed, auto_s, chosen = np.zeros(len(budgets)), 0.0, collections.Counter()
    for seed in range(FLAGS.seeds):
      rng = np.random.default_rng(seed)
      x, acc = draws(rng, FLAGS.batch, steps, a, FLAGS.depth, FLAGS.shape_k)
      fixed += [run_fixed(j, acc, FLAGS.batch, FLAGS.tokens, cost) for j in range(len(budgets))]
      s, c = run_auto(budgets, cost, x, acc, d, m, FLAGS.rho, FLAGS.tokens)
      auto_s += s
      chosen.update(c)
    per_ms = lambda ms: FLAGS.batch * FLAGS.tokens * FLAGS.seeds / ms
    tps = [per_ms(f) for f in fixed]
    auto_tps = per_ms(auto_s)
    print(f"{m:>5.2f} " + "".join(f"{v:>9.2f}" for v in tps)
          + f"{auto_tps:>9.2f}{auto_tps / max(tps):>8.2f}{auto_tps / min(tps):>8.2f}  "
          + ", ".join(f"{'AR' if b == 0 else b} x{n}" for b, n in sorted(chosen.items())))
  print("(tokens per ms of each option; auto / best and / worst fixed option)")


if __name__ == "__main__":
  app.run(main)
