"""Temporary (calls 3-4, run from the repo root as loopsync.py): bench_step with other
decode-loop drivers (env LOOP):
  while    decode.decode_loop as it is (lax.while_loop: XLA reads the predicate back every step)
  fori     a fixed-trip fori_loop of max_steps steps (known trip count: no predicate readback)
  chunkK   a while_loop over fori_loops of K steps (one readback per K steps)
  foricond a fixed-trip fori_loop whose body is lax.cond(all done, skip, step) (run with
           XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL for a device-side branch)
bench_step's random drafter accepts ~1 token per step, so every driver runs the same 16 steps.
Call 3 used an earlier version of this file with the fori driver only."""
import functools, os, sys
import jax
sys.path.insert(0, "experiments")
from absl import app
from ddtree_jax import decode, sharding
import bench_step

LOOP = os.environ.get("LOOP", "while")


def make(kind):
  @functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc"), donate_argnames=("state",))
  def loop(tparams, dparams, state, *, tcfg, dcfg, lc):
    max_steps = max(lc.max_new_tokens - 1, 0)
    one = lambda s: sharding.constrain(decode.step(tparams, tcfg, dparams, dcfg, lc, s), lc.mesh,
                                       lc.rules)
    cond = lambda s: (s.step < max_steps) & ~jax.numpy.all(s.done)
    if kind == "fori":
      return jax.lax.fori_loop(0, max_steps, lambda i, s: one(s), state)
    if kind.startswith("chunk"):
      k = int(kind[5:])
      return jax.lax.while_loop(cond, lambda s: jax.lax.fori_loop(0, k, lambda i, s: one(s), s),
                                state)
    if kind == "foricond":
      return jax.lax.fori_loop(
          0, max_steps, lambda i, s: jax.lax.cond(cond(s), one, lambda s: s, s), state)
    raise ValueError(kind)
  return loop


if LOOP != "while":
  decode.decode_loop = make(LOOP)
print(f"decode loop driver: {LOOP}  XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}", flush=True)

if __name__ == "__main__":
  app.run(bench_step.main)
