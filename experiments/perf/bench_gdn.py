"""The tree's recurrent part: one Gated DeltaNet layer over a draft tree of N = B + 1 nodes (the
verify's `gated_deltanet.block`, then the commit of an accepted path), random bf16 weights at a
hybrid shape's widths, against the bytes it must move (weights, state read and written).

  python -m experiments.perf.bench_gdn --shape=qwen3.5-9b --budgets=0,16,32,64,128 --batches=1,8
  python -m experiments.perf.bench_gdn --small          # tiny widths, runs on CPU (smoke)

--rules picks the tree's delta rule: xla (`gated_deltanet.tree`, XLA's kernels) and / or pallas
(`pallas.delta_tree`, one launch), each row timed on both in one run.

Prints the floors' bandwidth (`floors.measure`, also a JSON row), one JSON row per (batch,
budget) and a table; a tree here is a chain when B = 0 (AR) and otherwise a random tree of that
many nodes (each node's parent drawn below it). A layer alone is
too short to time by its call (the launch costs more than the layer), so one program applies it
`--stack` times over (its output the next input, the committed state carried) and the layer's
time is the slope between that and a program of one.
"""

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.kernels import Kernels, KernelTuning
from ddtree_jax.models import gated_deltanet as gd
from ddtree_jax.tools import profiling
from experiments.perf import common_flags, floors, harness

common_flags.define("small", "repeats", "json_out", "floor_bandwidth", shape="qwen3.5-9b")
flags.DEFINE_string("budgets", "0,16,32,64,128", "tree budgets (0: the root alone)")
flags.DEFINE_string("batches", "1,8", "batch sizes")
flags.DEFINE_string("rules", "xla,pallas", "the tree's delta rule: xla, pallas (comma list)")
flags.DEFINE_integer("stack", 8, "layer applications per timed program (the slope's far end)")
FLAGS = flags.FLAGS


def tree_of(n: int, rng):
  """parents [N] (each below its node, the root -1) and the ancestor-or-self visibility."""
  parents = np.asarray([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
  anc = np.eye(n, dtype=bool)
  for i in range(1, n):
    anc[i] |= anc[parents[i]]
  depth = anc.sum(1) - 1
  return parents, anc, depth


def main(_):
  cfg = harness.target_config(FLAGS.small, FLAGS.shape)
  if cfg.gdn is None:
    raise app.UsageError(f"--shape={FLAGS.shape} has no Gated DeltaNet layers")
  d, h = cfg.gdn, cfg.hidden_size
  p = gd.init_params(d, h, jax.random.key(0), jnp.bfloat16)
  weights = sum(x.nbytes for x in jax.tree.leaves(p))
  state_bytes = d.value_heads * d.key_dim * d.value_dim * 4
  bw = floors.measure(FLAGS.small, FLAGS.floor_bandwidth)
  print(bw.describe(), flush=True)
  rng = np.random.default_rng(0)
  rows = []
  common_flags.keep_row(rows, bw.row(), FLAGS.json_out)

  def stacked(k, rule):
    """k applications of the layer, each verifying the tree and committing its path."""
    def run(x, positions, visible, state, window, src, count):
      def layer(_, carry):
        x, state, window = carry
        y, pending = gd.block(p, d, x, positions, visible, state, window, chain=False, rule=rule)
        return (y, *gd.commit_block(state, window, pending, src, count))
      return jax.lax.fori_loop(0, k, layer, (x, state, window))
    return jax.jit(run)

  # the kernel at every budget (the engine keeps XLA's form past delta_tree_max_nodes)
  every_tree = KernelTuning(delta_tree_max_nodes=1 << 30)
  rules = {"xla": gd.tree, "pallas": Kernels(attention="pallas", tuning=every_tree).delta_tree}
  unknown = set(FLAGS.rules.split(",")) - set(rules)
  if unknown:
    raise app.UsageError(f"--rules: unknown {sorted(unknown)}; valid: {sorted(rules)}")
  programs = {name: (stacked(1, rules[name]), stacked(FLAGS.stack, rules[name]))
              for name in FLAGS.rules.split(",")}
  for b in harness.ints(FLAGS.batches):
    for budget in harness.ints(FLAGS.budgets):
      n = budget + 1
      _, anc, depth = tree_of(n, rng)
      x = jax.random.normal(jax.random.key(1), (b, n, h), jnp.bfloat16)
      positions = jnp.broadcast_to(jnp.asarray(depth + 100, jnp.int32), (b, n))
      visible = jnp.broadcast_to(jnp.asarray(anc), (b, n, n))
      state = 0.1 * jax.random.normal(jax.random.key(2), (b, d.value_heads, d.key_dim,
                                                           d.value_dim), jnp.float32)
      window = jax.random.normal(jax.random.key(3), (b, d.conv_kernel - 1, d.key_heads,
                                                     d.group_dim), jnp.bfloat16)
      path = np.flatnonzero(anc[n - 1])                       # the last node's root path
      src = jnp.broadcast_to(jnp.asarray(path, jnp.int32), (b, len(path)))
      count = jnp.full((b,), len(path), jnp.int32)
      args = (x, positions, visible, state, window, src, count)
      for name, (one, many) in programs.items():
        for f in (one, many):  # a warm-up beyond median_seconds': on a CPU the first interpreted
          jax.block_until_ready(f(*args))  # program's second call still takes ~1 s
        t1, tk = (profiling.median_seconds(f, *args, repeats=FLAGS.repeats) for f in (one, many))
        ms = (tk - t1) / (FLAGS.stack - 1) * 1e3
        row = {"section": "layer", "shape": FLAGS.shape, "rule": name, "batch": b,
               "budget": budget, "nodes": n, "ms": ms, "layers": len(cfg.recurrent_layers),
               "all_layers_ms": ms * len(cfg.recurrent_layers)}
        floors.mark(row, ms, weights + 2 * b * state_bytes, bw)
        common_flags.keep_row(rows, row, FLAGS.json_out)
  print(f"\n== One Gated DeltaNet layer over a tree of B + 1 nodes ({FLAGS.shape}), then commit")
  print(f"{'rule':>7}{'batch':>6}{'B':>6}{'ms':>10}{'floor ms':>10}{'ratio':>8}{'x spec':>8}"
        f"{'x layers ms':>13}")
  for r in (r for r in rows if r["section"] == "layer"):
    print(f"{r['rule']:>7}{r['batch']:>6}{r['budget']:>6}{r['ms']:>10.3f}{r['floor_ms']:>10.3f}"
          f"{r['ratio_to_floor']:>8.2f}{floors.x_spec(r)}{r['all_layers_ms']:>13.3f}"
          f"{floors.flag(r)}")
  floors.check(rows)


if __name__ == "__main__":
  app.run(main)
