"""Temporary: the int8 drafter's W8A8 glue kernels alone (us per call, 32 chained calls in one jit),
Pallas at several num_warps and a two-pass chunked silu_quant, against XLA's ops; H200."""
import functools, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from ddtree_jax import model
from ddtree_jax.pallas import w8a8

N, R, H, I = 32, 16, 4096, 12288
bf = jnp.bfloat16

import tempfile, os
import profile_step

def timeit(fn, *args):
  """Device kernel time per call (all kernels of the chain / N), from a profiler trace (run with
  XLA's command buffers off so every kernel is traced), and the kernel count per call."""
  jax.clear_caches()
  f = jax.jit(lambda *a: fn(*a))  # a new function object: no traced-jaxpr cache hit
  jax.block_until_ready(f(*args))
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(3):
      jax.block_until_ready(f(*args))
  ev = profile_step.kernel_events(profile_step.read_trace(d))
  return sum(e[1] for e in ev) / (3 * N), len(ev) / (3 * N)

def chunked_silu(g_ref, u_ref, sx_ref, gs_ref, us_ref, q_ref, s_ref, *, n, width, dt, chunk=2048):
  f32 = jnp.float32
  rnd = lambda v: v.astype(dt).astype(f32)
  sx = sx_ref[...]
  nc = pl.cdiv(n, chunk)
  def act(c):
    idx = c * chunk + jnp.arange(chunk)
    ok = idx < n
    load = lambda ref: plgpu.load(ref.at[pl.ds(c * chunk, chunk)], mask=ok, other=0)
    g = rnd(load(g_ref).astype(f32) * sx * load(gs_ref))
    u = rnd(load(u_ref).astype(f32) * sx * load(us_ref))
    return rnd(rnd(g * rnd(1.0 / (1.0 + jnp.exp(-g)))) * u), ok
  amax = jax.lax.fori_loop(0, nc, lambda c, m: jnp.maximum(m, jnp.max(jnp.abs(act(c)[0]))), jnp.float32(0))
  s = jnp.where(amax > 0, amax / 127.0, 1.0)
  def put(c, carry):
    a, ok = act(c)
    plgpu.store(q_ref.at[pl.ds(c * chunk, chunk)], w8a8._round_half_even(a / s).astype(jnp.int8), mask=ok)
    return carry
  jax.lax.fori_loop(0, nc, put, 0)
  s_ref[...] = s

y = jax.random.randint(jax.random.key(0), (1, R, 2, I), -3000, 3000, jnp.int32)
sx0 = jnp.full((1, R), 0.01, jnp.float32)
wsc = jnp.full((2, I), 1e-3, jnp.float32)

def silu_chain(y, sx, wsc):
  qs = []
  for _ in range(N):
    r = w8a8.silu_quant.__wrapped__(y, sx, wsc, dtype=bf, interpret=False)
    qs.append(r.q); sx = r.scale
  return qs

def silu_xla(y, sx, wsc):
  qs = []
  for _ in range(N):
    gu = (y.astype(jnp.float32) * sx[..., None, None] * wsc).astype(bf)
    r = model.quantize_rows(jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1])
    qs.append(r.q); sx = r.scale
  return qs

fmt = lambda name, t: f"{name:<24}{t[0]:>10.2f}{t[1]:>9.1f}"
print(f"{'silu_quant variant':<24}{'us/call':>10}{'kernels':>9}", flush=True)
print(fmt('xla', timeit(silu_xla, y, sx0, wsc)), flush=True)
orig = w8a8._silu_kernel
orig_round = w8a8._round_half_even
def magic_round(x):
  m = jnp.float32(12582912.0)  # 1.5 * 2**23: x + m rounds x to an integer, ties to even
  return (x + m) - m
for name, kern, warps in (("w8", orig, 8), ("w16", orig, 16), ("w32", orig, 32), ("w4", orig, 4),
                          ("chunked w4", chunked_silu, 4), ("chunked w8", chunked_silu, 8),
                          ("chunked1024 w4", functools.partial(chunked_silu, chunk=1024), 4),
                          ("chunked4096 w8", functools.partial(chunked_silu, chunk=4096), 8),
                          ("w8 magic", orig, 8), ("w16 magic", orig, 16), ("chunked w4 magic", chunked_silu, 4)):
  w8a8._silu_kernel, w8a8.NUM_WARPS = kern, warps
  w8a8._round_half_even = magic_round if "magic" in name else orig_round
  try:
    print(fmt(name, timeit(silu_chain, y, sx0, wsc)), flush=True)
  except Exception as e:
    print(name, "failed", str(e)[:300], flush=True)
w8a8._silu_kernel, w8a8.NUM_WARPS, w8a8._round_half_even = orig, 8, orig_round

for int8 in (False, True):
  s = 8
  p = (jax.random.randint(jax.random.key(2), (N, s, R, H), -3000, 3000, jnp.int32) if int8 else
       jax.random.normal(jax.random.key(2), (N, s, R, H), jnp.float32))
  p = [p[i] for i in range(N)]  # distinct per call, separate arrays (no slicing in the jit)
  x0 = jax.random.normal(jax.random.key(3), (R, H), bf)
  w = jnp.ones((H,), bf)
  sc = (jnp.full((R,), 0.01, jnp.float32), jnp.full((H,), 1e-3, jnp.float32)) if int8 else ()
  def an_chain(p, x, w, *sc):
    qs = []
    for i in range(N):
      x, r = w8a8.add_norm_quant.__wrapped__(p[i], x, w, *sc, eps=1e-6, interpret=False)
      qs.append(r.q)
    return x, qs
  def an_xla(p, x, w, *sc):
    qs = []
    for i in range(N):
      yy = jnp.sum(p[i], axis=0).astype(jnp.float32)
      if sc:
        yy = yy * sc[0][:, None] * sc[1]
      x = x + yy.astype(bf)
      r = model.quantize_rows(model.rms_norm(x, w, 1e-6))
      qs.append(r.q)
    return x, qs
  print(f"\n{'add_norm_quant ' + ('int8' if int8 else 'f32'):<24}{'us/call':>10}", flush=True)
  print(fmt('xla', timeit(an_xla, p, x0, w, *sc)), flush=True)
  for warps in (8, 16, 32, 4, -8, -16, -4):
    w8a8.NUM_WARPS = abs(warps)
    w8a8._round_half_even = magic_round if warps < 0 else orig_round
    try:
      print(fmt('w' + str(abs(warps)) + (" magic" if warps < 0 else ""), timeit(an_chain, p, x0, w, *sc)), flush=True)
    except Exception as e:
      print(warps, "failed", str(e)[:300], flush=True)
  w8a8.NUM_WARPS, w8a8._round_half_even = 8, orig_round
