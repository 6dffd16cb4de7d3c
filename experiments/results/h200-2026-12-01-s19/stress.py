"""Temporary (device call 1): the in-kernel merge under repetition: N runs of the kernel must give
the same bits every time (the merge order is fixed whichever program merges) and match XLA's
merge. Shapes: the B=64 verify (T=65), AR decode (T=1), batch 8 B=32, the drafter block (T=16)."""
import importlib, sys, time
import numpy as np
import jax, jax.numpy as jnp
TA = importlib.import_module("ddtree_jax.pallas.tree_attention")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 500
for b, t, plen in ((1, 65, 1024), (1, 1, 1024), (8, 33, 700), (1, 16, 1024)):
  hq, hkv, s, d = 32, 8, 1057, 128
  ks = jax.random.split(jax.random.key(t + b), 6)
  f = lambda k, *sh: jax.random.normal(k, sh, jnp.float32).astype(jnp.bfloat16)
  q, kc, vc, kn, vn = f(ks[0], b, t, hq, d), f(ks[1], b, hkv, s, d), f(ks[2], b, hkv, s, d), \
      f(ks[3], b, t, hkv, d), f(ks[4], b, t, hkv, d)
  mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
  pl_ = jnp.full((b,), plen, jnp.int32)
  cfg = TA.attention_config(q.shape, kc.shape)
  fk = jax.jit(lambda *a: TA.tree_attention(*a, scale=d ** -0.5, merge="kernel"))
  fx = jax.jit(lambda *a: TA.tree_attention(*a, scale=d ** -0.5, merge="xla"))
  args = (q, kc, vc, pl_, kn, vn, mask)
  first = np.asarray(fk(*args).astype(jnp.float32))
  want = np.asarray(fx(*args).astype(jnp.float32))
  diff = 0
  t0 = time.perf_counter()
  outs = [fk(*args) for _ in range(N)]
  for o in outs:
    diff += int(not np.array_equal(np.asarray(o.astype(jnp.float32)), first))
  dt = time.perf_counter() - t0
  err = float(np.abs(first - want).max())
  print(f"b={b} t={t} splits={cfg['num_splits']}: {N} runs, {diff} differ from the first; "
        f"max |kernel - xla merge| = {err:.3g} (bf16 ulp-level expected); {dt:.1f}s", flush=True)
  assert diff == 0 and err < 0.02
print("stress OK")
