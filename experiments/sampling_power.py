"""Power of tests/test_sampling.py's distribution test against a planted non-root bias.

  .venv/bin/python -m experiments.sampling_power [--sims=2000] [--null_sims=10000] [--leak=0.05]
      [--engine_check]

For every case of `test_sampling.CASES` (the test's target, drafter, rows, statistics and
decision) it computes the exact law of the first K tokens twice, in NumPy from the target's
exact conditionals and the case's trees (the table drafter's, built by `tree.build_tree` /
`tree.chain_tree` for every history): under the correct walk, and under the rule of
`test_sampling.leaky_commit`, which at every non-root node with a child replaces the target's
sample by the first child's token with probability --leak. It then draws multinomial samples of
the test's rows (N, or N_CHAIN for chain) from each law and applies the test's decision
(`test_sampling.passes`): the rejection rate under the biased law (--sims runs) is the power,
under the exact law (--null_sims runs) the false-alarm rate; the last line combines the cases
(the parametrized test fails if one case does). It also prints the largest cell of the joint
law and the share of rounds that commit 3+ tokens (exact, under the correct walk).

--engine_check also runs the engine with the planted rule for each case (the test's rows, one
seed) and prints the chi-squared p-value of its counts against the NumPy biased law (a check of
this script's model of the walk; several minutes on a CPU).
"""

import os
import sys
import time

from absl import app
from absl import flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the platform choice)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

import test_sampling as ts  # noqa: E402  (the test's target, drafter, cases and decision)
from ddtree_jax.speculative import tree as tree_lib  # noqa: E402

_SIMS = flags.DEFINE_integer("sims", 2000, "simulated runs per case under the biased law")
_LEAK = flags.DEFINE_float("leak", 0.05, "probability that a non-root node's sample is replaced "
                           "by its first child's token (the planted bias)")
_SEED = flags.DEFINE_integer("seed", 0, "NumPy seed of the simulated runs")
_N = flags.DEFINE_integer("n", 0, "rows per simulated run (0: the test's, N or N_CHAIN)")
_NULL_SIMS = flags.DEFINE_integer("null_sims", 10000, "simulated runs per case under the exact "
                                  "law (false alarms are rare: more runs than for the power)")
_ENGINE = flags.DEFINE_bool("engine_check", False, "also run the engine with the planted rule "
                            "and compare its counts with the NumPy biased law")


def trees(table, method, budget):
  """(tokens, parents) [H, n] of the tree every history's row verifies (`TableConfig` order)."""
  logits = jnp.asarray(table)
  root = jnp.zeros(table.shape[0], jnp.int32)  # the root's token plays no part in the walk
  if method == "chain":
    t = tree_lib.chain_tree(logits, root)
  else:
    t = tree_lib.build_tree(logits, budget, root_token=root)
  return np.asarray(t.tokens), np.asarray(t.parents)


def code(history):
  """The row of `history` (tokens after PROMPT, bonus included) in `history_table`."""
  n, v = len(history), ts.V
  return (v**n - v) // (v - 1) + int(np.ravel_multi_index(history, (v,) * n))


def walk_law(conds, tokens, parents, leak, k=ts.K):
  """(p(x1..x_k) [V] * k under the walk with the planted rule at `leak`, share of rounds that
  commit 3+ tokens). x1 is prefill's sample; each round starts at the root of the last emitted
  token's history's tree and moves to the child carrying each new sample, until a sample has
  no child (it is the bonus, the next round's root) or k tokens are out."""
  children = []
  for toks, pars in zip(tokens, parents):
    kids = [dict() for _ in toks]
    for i in range(1, len(toks)):
      kids[pars[i]].setdefault(int(toks[i]), i)  # siblings carry distinct tokens
    children.append(kids)
  law = np.zeros((ts.V,) * k)
  rounds = multi = 0.0
  for seq in np.ndindex(*law.shape):
    prob, tree, node, count = conds[0][seq[0]], None, 0, 0
    lengths = []
    for t in range(1, k):
      if node == 0:
        tree = children[code(seq[:t])]
      p = conds[t][seq[:t]]
      kids = tree[node]
      if node > 0 and kids:  # the first child: the lowest index (the highest draft score)
        first = min(kids.items(), key=lambda kv: kv[1])[0]
        p = (1 - leak) * p + leak * np.eye(ts.V)[first]
      prob *= p[seq[t]]
      count += 1
      node = kids.get(seq[t], 0)
      if node == 0:
        lengths.append(count)
        count = 0
    if count:
      lengths.append(count)
    law[seq] = prob
    rounds += prob * len(lengths)
    multi += prob * sum(c >= 3 for c in lengths)
  return law, multi / rounds


def rejection_rate(law, conds, sims, n, rng):
  """Share of simulated runs (multinomial draws of n rows from `law`) the decision rejects."""
  flat = law.ravel() / law.sum()
  fails = 0
  for _ in range(sims):
    counts = rng.multinomial(n, flat).reshape(law.shape).astype(np.float64)
    fails += not ts.passes(ts.verdict(counts, conds))
  return fails / sims


def engine_check(target, conds, method, budget, temperature, filters, biased_law):
  """p-value of the engine's counts under the planted rule against `biased_law`."""
  from ddtree_jax import engine
  from ddtree_jax.speculative import decode  # pylint: disable=import-outside-toplevel
  real_commit = decode.accept_and_commit
  engine._PROGRAMS.clear()  # pylint: disable=protected-access
  jax.clear_caches()
  decode.accept_and_commit = ts.leaky_commit(real_commit, _LEAK.value)
  try:
    counts, _ = ts.sample(target, ts.table_drafter(conds), method, budget, temperature, k=ts.K,
                          n=ts.rows(method), **filters)
  finally:
    decode.accept_and_commit = real_commit
    engine._PROGRAMS.clear()  # pylint: disable=protected-access
    jax.clear_caches()
  return ts.pooled_chisquare(counts.ravel(), counts.sum() * biased_law.ravel())


def main(_):
  jax.config.update("jax_default_matmul_precision", "highest")
  rng = np.random.default_rng(_SEED.value)
  target = ts.make_target()
  null_sims = _NULL_SIMS.value
  print(f"K {ts.K} tokens, V {ts.V}, alpha {ts.ALPHA}, leak {_LEAK.value}; {_SIMS.value} "
        f"simulated runs per case under the biased law, {null_sims} under the exact law\n")
  head = ["case", "rows", "max cell", "3+ rounds", "power", "false alarm"]
  if _ENGINE.value:
    head.append("engine vs biased law p")
  print("| " + " | ".join(head) + " |")
  print("|" + " --- |" * len(head))
  t0 = time.perf_counter()
  missed = quiet = 1.0  # the chance that no case rejects: under the biased law, the exact law
  for method, budget, temperature, filters, _ in ts.CASES:
    conds = ts.conditionals(target, temperature, depth=ts.K + ts.L - 1, **filters)
    tokens, parents = trees(ts.history_table(conds), method, budget)
    exact, share = walk_law(conds, tokens, parents, 0.0)
    assert np.allclose(exact, ts.joint(conds, ts.K), atol=1e-9), "the walk must be exact"
    biased, _ = walk_law(conds, tokens, parents, _LEAK.value)
    n = _N.value or ts.rows(method)
    name = f"{method} B={budget or '-'} T={temperature} {filters or ''}".strip()
    power = rejection_rate(biased, conds[:ts.K], _SIMS.value, n, rng)
    alarm = rejection_rate(exact, conds[:ts.K], null_sims, n, rng)
    missed, quiet = missed * (1 - power), quiet * (1 - alarm)
    row = [name, str(n), f"{exact.max():.4f}", f"{share:.3f}", f"{power:.3f}", f"{alarm:.4f}"]
    if _ENGINE.value:
      row.append(f"{engine_check(target, conds, method, budget, temperature, filters, biased):.3g}")
    print("| " + " | ".join(row) + " |", flush=True)
  print(f"| all cases (the test fails if one does) | | | | {1 - missed:.3f} | {1 - quiet:.4f} |"
        + " |" * _ENGINE.value)
  print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  app.run(main)
