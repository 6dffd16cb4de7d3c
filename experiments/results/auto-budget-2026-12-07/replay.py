"""The chooser (speculative/auto.py) replayed on the H100 step times of bench_auto (ms per step, COSTS) with the benchmark drafter's acceptance drawn through the real tree builder; argv: PRIOR, the first tier (low: smallest, high: largest), the back-off growth (read from auto.GROWTH, a constant auto.py had while it was tried; it doubles again since), MAX_BACKOFF. A driver of docs/findings/auto-budget.md, not a library tool."""
import sys, collections, math, numpy as np, jax, jax.numpy as jnp
from ddtree_jax.speculative import tree as tree_lib, verify, auto as auto_lib
from ddtree_jax.tools import benchmark_drafter as bd
V, L = 512, 15
BUD = [0, 8, 16, 32, 64]
def draws(a, n, seed):
  """acc [n, 4] accepted drafts per drafted budget, expected [4] (draft's own)."""
  pos = jnp.arange(1, L+1)[None] + 1000*jnp.arange(n)[:, None] + 10**6*seed
  rank = bd.true_rank(jnp, pos, jnp.zeros((n,1),jnp.int32), a, 0)
  y = (7 * pos) % V
  k = jnp.arange(bd.RANKS)
  off = jnp.where(k == rank[..., None], 0, k + (k < rank[..., None]))
  cand = (y[..., None] + off) % V
  c = min(max(a if a > 0 else 0.5, 1e-4), 1-1e-4)
  logp = math.log(c) + k * math.log1p(-c)
  rest = bd.RANKS*math.log1p(-c) - math.log(V - bd.RANKS)
  base = jnp.full((n, L, V), rest) + 1e-3*jax.random.normal(jax.random.key(seed), (n, L, V))
  logits = base.at[jnp.arange(n)[:,None,None], jnp.arange(L)[None,:,None], cand].set(jnp.broadcast_to(logp, cand.shape))
  t = tree_lib.build_tree(logits, 64, None, root_token=jnp.zeros((n,), jnp.int32))
  yfull = jnp.concatenate([y, jnp.zeros((n,1),jnp.int32)], 1)
  out = []
  for b in BUD[1:]:
    p = tree_lib.prefix(t, b + 1)
    post = jnp.take_along_axis(yfull, jnp.minimum(p.depths, L), axis=1)
    _, tau, _ = verify.accept(p.tokens, p.parents, p.depths, p.visibility, post, L)
    out.append(np.asarray(tau) - 1)
  exp = np.asarray(auto_lib.expected_accepted(t.scores, tuple(BUD)))[0]
  return np.stack(out, 1), exp
def run(cost, acc, exp, batch, tokens, init_tier):
  has_ar, drafted = 1, 4
  steps = tokens + 1
  auto = auto_lib.AutoState.init(jnp.asarray(cost), batch, steps, drafted)
  auto = auto.__class__(**{**auto.__dict__, "tier": jnp.int32(init_tier)})
  left, t, chosen, idx = np.full(batch, tokens), 0.0, collections.Counter(), 0
  for step in range(steps):
    live = left > 0
    if not live.any(): break
    if int(auto.skip) > 0:
      j, got, pred, back_off, tier = 0, np.zeros(batch, np.int32), np.zeros(batch), False, None
    else:
      tier = int(auto.tier); n = has_ar + tier + 1
      e = np.broadcast_to(exp[:n], (batch, n))
      i, back_off, tier = auto_lib.decide(auto, jnp.asarray(e, jnp.float32), jnp.asarray(live), tier, has_ar, drafted)
      j = 1 + int(i)
      got = acc[idx:idx+batch, j-1]; idx += batch; pred = e[:, j]
    left = left - np.where(live, 1 + got, 0); t += cost[j]; chosen[BUD[j]] += 1
    auto = auto_lib.after_step(auto, step, jnp.int32(BUD[j]), jnp.asarray(pred, jnp.float32), jnp.asarray(got), jnp.asarray(live), back_off, tier)
  return t, chosen
def fixed(cost, acc, j, batch, tokens):
  left, t, idx = np.full(batch, tokens), 0.0, 0
  while (left > 0).any():
    got = acc[idx:idx+batch, j-1] if j else 0; idx += batch
    left = left - np.where(left > 0, 1 + got, 0); t += cost[j]
  return t
COSTS = {"8b1": [5.79, 7.28, 7.59, 7.79, 8.16], "8b8": [6.08, 8.70, 9.29, 10.92, 16.97], "30b1": [3.74, 12.21, 15.2, 17.36, 19.34]}
prior = float(sys.argv[1]); init = sys.argv[2]; auto_lib.GROWTH = int(sys.argv[3]); auto_lib.MAX_BACKOFF = int(sys.argv[4])
auto_lib.PRIOR = prior
for a in [0.0, 0.6, 0.9, 0.95]:
  acc, exp = draws(a, 1200, 0)
  for name, cost in COSTS.items():
    batch = 8 if name.endswith("8") else 1
    cost = np.asarray(cost)
    res = []
    for seed in range(6):
      rng = np.random.default_rng(seed); perm = rng.permutation(len(acc)); A = acc[perm]
      fx = [fixed(cost, A, j, batch, 128) for j in range(5)]
      at, ch = run(cost, A, exp, batch, 128, 0 if init == "low" else 3)
      res.append((fx, at))
    fx = np.sum([r[0] for r in res], 0); at = sum(r[1] for r in res)
    best = min(fx[1:]); print(f"a={a} {name}: auto/bestfixed {best/at:.2f} auto/AR {fx[0]/at:.2f} auto/bestall {min(fx)/at:.2f}", flush=True)
