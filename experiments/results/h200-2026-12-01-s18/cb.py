"""Temporary (device call): the B=64 (and AR) step under XLA's command-buffer scheduling modes
(LHS = default, CONCURRENT = a DAG from buffer dependencies) and, under CONCURRENT, with the
layer's wo streamed into L2 by a separate Pallas kernel that runs beside the tree attention.
ONE process, so every variant shares the GEMM autotuning picks; interleaved timing."""
import functools, json, os, sys
sys.path.insert(0, "experiments")
from absl import app
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np
import bench_step as bs
from ddtree_jax import drafter as drafter_lib, model

ROWS = int(os.environ.get("PF_ROWS", "8"))      # rows of w per load
PROGS = int(os.environ.get("PF_PROGS", "64"))    # programs (each loops over its rows)
MIN_T = 32


def _pf_kernel(w_ref, dep_ref, o_ref, *, per):
  acc = jnp.zeros((ROWS, w_ref.shape[1]), jnp.float32)
  for j in range(per):
    acc += plgpu.load(w_ref.at[pl.ds(j * ROWS, ROWS), :], eviction_policy="evict_last").astype(jnp.float32)
  o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)


def prefetch(w, dep, interpret=False):
  """Reads all of w [..., H] with evict_last (into L2) -> f32[PROGS, 16] checksum; dep is an
  unread input that orders the kernel after dep's producer."""
  h = w.shape[-1]
  w2 = w.reshape(-1, h)
  n = w2.shape[0]
  per = n // PROGS // ROWS
  assert per * PROGS * ROWS == n, (n, PROGS, ROWS)
  dep2 = dep.reshape(-1, dep.shape[-1])
  return pl.pallas_call(
      functools.partial(_pf_kernel, per=per),
      grid=(PROGS,),
      in_specs=[pl.BlockSpec((n // PROGS, h), lambda i: (i, 0)),
                pl.BlockSpec((1, dep2.shape[-1]), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((1, h), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((PROGS, h), jnp.float32),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
      name="l2_prefetch",
  )(w2, dep2)


_orig_block = model.attention_block


def prefetch_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask, attn_fn,
                   cache_layer=None, qk_fn=None, res_fn=None):
  if x.shape[1] < MIN_T:
    return _orig_block(layer, cfg, x, h, cos, sin, k_cache, v_cache, prefix_len, new_mask,
                       attn_fn, cache_layer, qk_fn, res_fn)
  q, k, v = model.project_qkv(layer, cfg, h, cos, sin, qk_fn)
  tok = prefetch(layer.wo, q)
  kw = {} if cache_layer is None else {"layer": cache_layer}
  o = attn_fn(q, k_cache, v_cache, prefix_len, k, v, new_mask, scale=cfg.head_dim ** -0.5, **kw)
  o, tok = jax.lax.optimization_barrier((o, tok))
  x, h = (res_fn or model.residual_norm)(x, "btnd,ndh->bth", o, layer.wo, layer.post_norm,
                                         eps=cfg.rms_norm_eps)
  return x, h, k, v


def main(_):
  global PROGS, ROWS
  if os.environ.get("PF_CHECK"):
    w = jax.random.normal(jax.random.key(0), (32, 128, 4096), jnp.bfloat16)
    t = jax.block_until_ready(jax.jit(prefetch)(w, jnp.ones((1, 65, 32, 128), jnp.bfloat16)))
    ref = w.reshape(PROGS, -1, 4096).astype(jnp.float32).sum(1)
    print("prefetch checksum err", float(jnp.max(jnp.abs(t - ref))), flush=True)
  tcfg = bs.qwen3_8b(False)
  tp = bs.target_params(tcfg, jax.random.key(0))
  dp, dcfg = bs.make_drafter(tcfg, jax.random.key(1), False)
  dp = jax.jit(drafter_lib.quantize_int8)(dp, tp)
  dp = drafter_lib.restrict_vocab(dp, tp, np.arange(32768))
  steps, prefix = 16, 1024
  # RUNS: method:budget:batch list; MODES: command-buffer scheduling modes; PF: prefetch
  # variants (programs x rows, CONCURRENT, DDTree runs only).
  runs = [r.split(":") for r in os.environ.get("RUNS", "ddtree:64:1").split(",")]
  modes = os.environ.get("MODES", "LHS,CONCURRENT").split(",")
  pfs = [tuple(map(int, p.split("x"))) for p in os.environ.get("PF", "").split(",") if p]
  variants = []
  for method, budget, batch in runs:
    for m in modes:
      variants.append((method, int(budget), int(batch), m, None))
    if method == "ddtree":
      variants += [(method, int(budget), int(batch), "CONCURRENT", pf) for pf in pfs]
  rows = []
  for method, budget, batch, mode, pf in variants:
    model.attention_block = _orig_block if pf is None else prefetch_block
    if pf is not None:
      PROGS, ROWS = pf
    jax.clear_caches()
    lc = bs.decode.LoopConfig(method=method, max_new_tokens=steps + 1,
                              num_drafts=0 if method == "ar" else 15, budget=budget,
                              attention="pallas")
    d = (None, None) if method == "ar" else (dp, dcfg)
    shape = bs.state_shape(tcfg, d[1], lc, batch, prefix)
    loop = bs.decode.decode_loop.lower(tp, d[0], shape, tcfg=tcfg, dcfg=d[1], lc=lc).compile(
        compiler_options={"xla_gpu_command_buffer_scheduling_mode": mode})
    name = mode.lower() + ("" if pf is None else f"+pf{pf[0]}x{pf[1]}")
    mem = loop.memory_analysis()
    print(json.dumps({"compiled": f"{method}:{budget}:{batch}", "variant": name,
                      "temp_MB": round(mem.temp_size_in_bytes / 2**20, 1)}), flush=True)
    rows.append((method, budget, batch, name, lc, loop, d))
  model.attention_block = _orig_block
  ref = {}
  for rep in range(int(os.environ.get("REPS", "3"))):
    for method, budget, batch, name, lc, loop, d in rows:
      ms = bs.time_loop(loop, tp, tcfg, d[0], d[1], lc, batch, prefix, 5) * 1e3
      st = bs.make_state(jax.random.key(1), tcfg, d[1], lc, batch, prefix)
      out = np.asarray(loop(tp, d[0], st).out)
      same = ref.setdefault((method, budget, batch), out)
      print(json.dumps({"rep": rep, "run": f"{method}:{budget}:{batch}", "variant": name,
                        "step_ms": round(ms, 3), "same_tokens": bool((out == same).all())}),
            flush=True)

if __name__ == "__main__":
  app.run(main)
