"""Temporary: add_rms_norm kernel variants, alone (us per call), H200."""
import functools, time, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from ddtree_jax.pallas import add_rms_norm as arn

def k_block(p_ref, x_ref, w_ref, xo_ref, ho_ref, *, eps, splits):
  f32, dt = jnp.float32, xo_ref.dtype
  rnd = lambda v: v.astype(dt).astype(f32)
  y = jnp.sum(p_ref[:, 0, :], axis=0)
  x = rnd(x_ref[0].astype(f32) + rnd(y))
  r = jax.lax.rsqrt(jnp.mean(x * x) + eps)
  xo_ref[0] = x.astype(dt)
  ho_ref[0] = (w_ref[...].astype(f32) * rnd(x * r)).astype(dt)

def k_pairs(p_ref, x_ref, w_ref, xo_ref, ho_ref, *, eps, splits):
  f32, dt = jnp.float32, xo_ref.dtype
  rnd = lambda v: v.astype(dt).astype(f32)
  ys = [p_ref[s, 0] for s in range(splits)]
  while len(ys) > 1:
    ys = [ys[i] + ys[i + 1] for i in range(0, len(ys), 2)]
  x = rnd(x_ref[0].astype(f32) + rnd(ys[0]))
  r = jax.lax.rsqrt(jnp.mean(x * x) + eps)
  xo_ref[0] = x.astype(dt)
  ho_ref[0] = (w_ref[...].astype(f32) * rnd(x * r)).astype(dt)

def run(kernel, warps, s, r=65, h=4096, n=64):
  arn._kernel, arn.NUM_WARPS = kernel, warps
  arn.add_rms_norm.clear_cache() if hasattr(arn.add_rms_norm, "clear_cache") else None
  parts = jax.random.normal(jax.random.key(0), (s, r, h), jnp.float32)
  x = jax.random.normal(jax.random.key(1), (r, h), jnp.bfloat16)
  w = jnp.ones((h,), jnp.bfloat16)
  @jax.jit
  def chain(parts, x, w):
    for _ in range(n):
      x, hh = arn.add_rms_norm.__wrapped__(parts, x, w, eps=1e-6)
      x = x + hh * 0  # keep the chain
    return x
  chain(parts, x, w).block_until_ready()
  ts = []
  for _ in range(15):
    t = time.perf_counter(); chain(parts, x, w).block_until_ready(); ts.append(time.perf_counter() - t)
  return np.median(ts) / n * 1e6

orig = arn._kernel
print(f"{'variant':<14}{'S':>3}{'us/call':>10}")
for s in (4, 8):
  for name, k, w in (("loop w4", orig, 4), ("loop w8", orig, 8), ("loop w16", orig, 16),
                     ("pairs w4", k_pairs, 4), ("pairs w8", k_pairs, 8),
                     ("block w8", k_block, 8), ("block w16", k_block, 16), ("loop w4 again", orig, 4)):
    try:
      print(f"{name:<14}{s:>3}{run(k, w, s):>10.2f}", flush=True)
    except Exception as e:
      print(name, s, "failed", str(e)[:200], flush=True)
