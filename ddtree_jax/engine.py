"""Public entry points: check a request, pad it to static shapes, run prefill + decode loop."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import auto_costs
from ddtree_jax.speculative import decode
from ddtree_jax.models import drafter as drafter_lib
from ddtree_jax import kernels as kernels_lib
from ddtree_jax.models import decoder
from ddtree_jax import sharding
from ddtree_jax.checkpoints.dflash import Drafter
from ddtree_jax.checkpoints.hf import Target
from ddtree_jax.request import (DEFAULT_BUDGETS, GenerateOptions, RequestError,
                                token_ids as check_token_ids)
from ddtree_jax.speculative.sampling import seed_key_data

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateResult:
  tokens: list[list[int]]          # new tokens per prompt, cut after the first stop token
  stats: dict[str, Any]


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


_PROGRAMS: dict = {}


def _programs(args, capacity, statics):
  """AOT-compiled (prefill, decode loop), cached by every static that shapes them."""
  key = (capacity, tuple(sorted(statics.items(), key=lambda kv: kv[0])),
         jax.tree.structure(args),
         tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args)))
  if key not in _PROGRAMS:
    lc, t0 = statics["lc"], time.perf_counter()
    what = (f"{lc.method}" + (f" B={lc.budget}" if lc.method == "ddtree" else "")
            + f", batch {args[2].shape[0]}, {capacity} cache rows, {lc.max_new_tokens} new tokens")
    _LOG.info("compiling prefill + decode loop (%s)...", what)
    prefill = decode.prefill.lower(*args, capacity=capacity, **statics).compile()
    # The loop takes the state exactly as prefill lays it out (shardings included).
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding),
                         prefill.out_info)
    loop = decode.decode_loop.lower(args[0], args[1], state, **statics).compile()
    _LOG.info("compiled (%s) in %.1f s", what, time.perf_counter() - t0)
    _PROGRAMS[key] = (prefill, loop)
  return _PROGRAMS[key]


def _prepare(target, prompts, options: GenerateOptions, drafter):
  """Checks a request and lays it out in static shapes: (args, capacity, statics)."""
  prompts, options = options.check(target, drafter, prompts)
  lens = np.array([len(p) for p in prompts], np.int32)
  t = _round_up(int(lens.max()), 16)
  tokens = np.zeros((len(prompts), t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  use_drafter = options.method != "ar"
  dcfg = drafter.config if use_drafter else None
  dparams = drafter.params if use_drafter else None
  mesh, rules = target.mesh, target.rules  # tensor/data parallel (sharding.py) with a mesh
  statics = dict(tcfg=target.config, dcfg=dcfg, lc=options.loop_config(dcfg, mesh, rules))
  tokens, lens = sharding.pad_batch((tokens, lens), mesh, rules)  # batch: a multiple of dp
  # keyed as the slot engine keys a request: a seed draws the same tokens, served or not
  key = jax.random.wrap_key_data(seed_key_data(options.seed), impl="threefry2x32")
  args = (target.params, dparams, sharding.put_batch(tokens, mesh, rules),
          sharding.put_batch(lens, mesh, rules), sharding.replicate(key, mesh))
  if options.budget == "auto":  # the costs: given, or measured with these programs (`_costs`)
    cost = np.ones(len(options.budgets)) if options.budget_costs is None else options.budget_costs
    args += (sharding.replicate(jnp.asarray(cost, jnp.float32), mesh),)
  return args, options.cache_capacity, statics


def _costs(args, capacity, statics, options: GenerateOptions):
  """args with budget="auto"'s costs: the options' own, or measured on this machine
  (`auto_costs`, cached on disk by device, code and shapes)."""
  if options.budget != "auto" or options.budget_costs is not None:
    return args
  prefill, loop = _programs(args, capacity, statics)
  key = auto_costs.cache_key(dict(statics, capacity=capacity), args)
  cost = auto_costs.cached(key, lambda: auto_costs.measure(prefill, loop, args, statics["lc"],
                                                           args[1]))
  return args[:-1] + (jax.device_put(jnp.asarray(cost, jnp.float32), args[-1].sharding),)


def budget_costs(target: Target, prompts: Sequence[Sequence[int]], **kwargs) -> dict[int, float]:
  """{budget: seconds per step} of `generate(target, prompts, budget="auto", **kwargs)`'s
  options, as it measures them (or finds them measured) on this machine."""
  options, drafter = _options(dict(kwargs, method="ddtree", budget="auto", budget_costs=None))
  args, capacity, statics = _prepare(target, prompts, options, drafter)
  args = _costs(args, capacity, statics, options.check_values())
  return dict(zip(statics["lc"].budgets, np.asarray(args[-1]).tolist()))


def _options(kwargs: dict) -> tuple[GenerateOptions, Drafter | None]:
  """(the options, the drafter) of `generate`'s keyword arguments."""
  kwargs = dict(kwargs)
  drafter = kwargs.pop("drafter", None)
  return GenerateOptions(**kwargs), drafter


def compile_only(target: Target, prompts: Sequence[Sequence[int]], **kwargs) -> float:
  """Compiles the programs `generate(target, prompts, **kwargs)` would run, without running
  them (a no-op when they are cached). Returns the seconds it took."""
  args, capacity, statics = _prepare(target, prompts, *_options(kwargs))
  t0 = time.perf_counter()
  _programs(args, capacity, statics)
  return time.perf_counter() - t0


def compile_many(target: Target, requests: Sequence[tuple[Sequence[Sequence[int]], dict]],
                 threads: int = 1) -> list[float]:
  """`compile_only` for each (prompts, generate kwargs) request, `threads` at a time (XLA
  compiles on the host, so distinct programs compile in parallel). Seconds per request; with
  threads > 1 they overlap."""
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    return list(pool.map(lambda r: compile_only(target, r[0], **r[1]), requests))


def prefill_state(target: Target, prompts: Sequence[Sequence[int]], **kwargs):
  """(the DecodeState right after prefill, the LoopConfig) that `generate(target, prompts,
  **kwargs)` would decode from: for tools that run the step's stages one by one."""
  args, capacity, statics = _prepare(target, prompts, *_options(kwargs))
  return decode.prefill(*args, capacity=capacity, **statics), statics["lc"]


def precompile(target: Target, *, batch: int, prompt_len: int, max_new_tokens: int,
               budgets=(), methods=("ar",), drafter: Drafter | None = None, threads: int = 1,
               **kwargs) -> dict[str, float]:
  """Ahead-of-time compiles the programs `generate` would use for requests of this shape:
  every method in `methods` ("ddtree" once per budget), `threads` programs at a time. Returns
  compile seconds per program. Pair with `enable_compilation_cache` to keep them across
  processes."""
  runs = [(m, b) for m in methods for b in (budgets if m == "ddtree" else (None,))]
  prompts = [[0] * prompt_len] * batch
  requests = [(prompts, dict(kwargs, method=m, budget=b, max_new_tokens=max_new_tokens,
                             drafter=drafter)) for m, b in runs]
  seconds = compile_many(target, requests, threads)
  return {m if b is None else f"{m}/{b}": s for (m, b), s in zip(runs, seconds)}


def enable_compilation_cache(path: str, min_compile_seconds: float = 0.0) -> None:
  """JAX's persistent compilation cache: compiled programs are stored under `path` and reused
  by later processes with the same shapes, budgets and versions. A process whose cache was
  already opened elsewhere moves to `path` (JAX opens it once, at the first compile)."""
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  os.makedirs(path, exist_ok=True)
  if jax.config.jax_compilation_cache_dir != path:
    compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ddtree_jax", "xla")


def define_compilation_cache_flags(default: bool = True) -> None:
  """absl flags --[no]compilation_cache (on by default) and --compilation_cache_dir (default
  $DDTREE_CACHE_DIR or ~/.cache/ddtree_jax/xla); every script defines them."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if "compilation_cache" in flags.FLAGS:
    return
  flags.DEFINE_bool("compilation_cache", default, "keep compiled programs in JAX's persistent "
                    "cache, so that a rerun with the same shapes compiles nothing")
  flags.DEFINE_string("compilation_cache_dir",
                      os.environ.get("DDTREE_CACHE_DIR", DEFAULT_CACHE_DIR),
                      "directory of the persistent compilation cache")


def compilation_cache_from_flags() -> str | None:
  """Turns the persistent cache on as the flags say; returns its directory (None: off)."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.compilation_cache:
    return None
  enable_compilation_cache(flags.FLAGS.compilation_cache_dir)
  return flags.FLAGS.compilation_cache_dir


def generate(target: Target, prompts: Sequence[Sequence[int]], *, method: str = "ar",
             max_new_tokens: int | None = None, temperature: float = 0.0, seed: int = 0,
             stop_token_ids=None, drafter: Drafter | None = None,
             budget: int | str | None = None, budgets: Sequence[int] = DEFAULT_BUDGETS,
             budget_costs: Sequence[float] | None = None, auto_every: int = 1,
             topk_cap: int | None = None, cache_capacity: int | None = None,
             attention: str | None = None, top_k: int | None = None,
             top_p: float | None = None, steps_per_check: int = 1,
             kernel_tuning: kernels_lib.KernelTuning | None = None) -> GenerateResult:
  """Generates up to `max_new_tokens` per prompt with AR, chain (DFlash) or DDTree decoding; the
  keywords but `drafter` are `request.GenerateOptions`' (with its defaults; a GenerateOptions
  `options` is `generate(target, prompts, drafter=..., **options.kwargs())`).

  temperature > 0 samples from the target's distribution (optionally top_k / top_p filtered);
  chain and ddtree then draw one target sample per tree node and walk the tree with them, so
  every committed token is a genuine target sample (lossless). Same seed, same output.
  The cache holds `cache_capacity` rows per sequence (default: the longest prompt plus
  max_new_tokens, rounded up to 128); requests that do not fit are refused, never clamped.
  steps_per_check > 1 checks the stop condition (a host round trip) once per that many steps,
  at the price of up to steps_per_check - 1 idle steps at the end (`decode.decode_loop`); the
  output and stats are the same. kernel_tuning: the Pallas kernels' tuning (`kernels.KernelTuning`;
  None: the defaults). budget="auto" chooses each step's budget among `budgets` (0: AR) from the
  draft's expected acceptance and each budget's step time (`budget_costs`, seconds per step;
  None: measured here first, `budget_costs()`), every `auto_every` steps (the steps between run
  the chosen budget's own step: `decode.auto_steps`); stats then hold each step's budget
  ("chosen"), each row's expected accepted drafts per choosing step ("predicted", 0 at the
  others) and the seconds this call spent measuring the costs ("auto_costs_seconds", apart from
  compile and prefill: 0 once they were measured in this process or found on disk for these
  shapes, or given). A second call of the same shapes and options reuses the compiled programs
  (`engine._PROGRAMS`); these shape them: batch, prompt length (in steps of 16), cache capacity,
  max_new_tokens, method, budget, temperature, top_k, top_p and stop ids.
  """
  options = GenerateOptions(
      method=method, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
      stop_token_ids=stop_token_ids, budget=budget, budgets=budgets, budget_costs=budget_costs,
      auto_every=auto_every, topk_cap=topk_cap,
      cache_capacity=cache_capacity, attention=attention, top_k=top_k, top_p=top_p,
      steps_per_check=steps_per_check, kernel_tuning=kernel_tuning)
  args, capacity, statics = _prepare(target, prompts, options, drafter)
  lc, dparams = statics["lc"], args[1]
  t0 = time.perf_counter()
  prefill, loop = _programs(args, capacity, statics)
  t1 = time.perf_counter()
  args = _costs(args, capacity, statics, options.check_values())
  t_costs = time.perf_counter()
  state = jax.block_until_ready(prefill(*args))
  t2 = time.perf_counter()
  state = jax.block_until_ready(loop(target.params, dparams, state))
  t3 = time.perf_counter()

  out, n_out, accepted, steps = sharding.to_host((state.out, state.n_out, state.accepted,
                                                  state.step))
  auto = {} if state.auto is None else dict(
      _auto_stats(state.auto, accepted, len(prompts), lc), auto_costs_seconds=t_costs - t1)
  n = len(prompts)  # rows past n are dp padding
  out, n_out, accepted = out[:n], n_out[:n], accepted[:, :n]
  steps = int(steps)
  per_seq = [[int(a) for a in accepted[:steps, b] if a > 0] for b in range(len(prompts))]
  flat = [a for seq in per_seq for a in seq]
  new_in_loop = int(n_out.sum()) - len(prompts)
  return GenerateResult(
      tokens=[out[b, :n_out[b]].tolist() for b in range(len(prompts))],
      stats={
          "method": method, "steps": steps,
          "budget": "auto" if lc.budgets else (lc.budget if method == "ddtree" else None),
          "tau": float(np.mean(flat)) if flat else 0.0,
          "acceptance_lengths": per_seq,
          "tokens_per_second": new_in_loop / (t3 - t2) if new_in_loop else 0.0,
          "compile_seconds": t1 - t0, "prefill_seconds": t2 - t_costs, "decode_seconds": t3 - t2,
          "cache_capacity": capacity, "attention": lc.kernels.attention, **auto,
      })


def _auto_stats(auto, accepted, n: int, lc) -> dict:
  """budget="auto"'s stats: the options and their costs, each step's chosen budget, each row's
  expected accepted drafts at the steps its acceptance_lengths list."""
  cost, chosen, predicted = sharding.to_host((auto.cost, auto.chosen, auto.predicted))
  steps = int(np.sum(np.any(accepted > 0, axis=1)))
  return {"budgets": list(lc.budgets), "budget_costs": [float(c) for c in cost],
          "chosen": chosen[:steps].tolist(),
          "predicted": [[float(p) for p, a in zip(predicted[:steps, b], accepted[:steps, b])
                         if a > 0] for b in range(n)]}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_logits(params, token_ids, *, cfg):
  b, t = token_ids.shape
  cache = decoder.init_target_cache(cfg, b, 0, params.embed.dtype)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, *_ = decoder.forward(params, cfg, token_ids, positions, cache,
                               decoder.causal_mask(jnp.full((b,), t), t), chain=True)
  return decoder.lm_head(params, hidden)


def forward_logits(target: Target, token_ids) -> jax.Array:
  """Plain causal forward, no cache: token_ids [B, T] -> float32 logits [B, T, V]."""
  ids = np.asarray(token_ids)
  if ids.ndim != 2 or not ids.size:
    raise RequestError(f"token_ids must be a non-empty [B, T] array, got shape {ids.shape}",
                       "token_ids")
  for i, row in enumerate(ids):
    check_token_ids(f"token_ids row {i}", row, target.config.vocab_size, "token_ids")
  if ids.shape[1] > target.config.max_position_embeddings:
    raise RequestError(f"{ids.shape[1]} tokens exceed the model's "
                       f"{target.config.max_position_embeddings} positions", "token_ids")
  return _forward_logits(target.params, jnp.asarray(ids, jnp.int32), cfg=target.config)


def draft_logits(target: Target, drafter: Drafter, prompt: Sequence[int]) -> jax.Array:
  """The drafter's logits [bs-1, V] for the first block after `prompt` (greedy bonus); [bs-1, Vd]
  over `drafter.params.draft_vocab` for a drafter with a draft vocabulary (build_tree's tokens
  are then column indices: map them with draft_vocab[tokens[..., 1:]])."""
  if not isinstance(drafter, Drafter):
    raise RequestError(f"drafter must be a Drafter (ddtree_jax.load_drafter), got "
                       f"{type(drafter).__name__}", "drafter")
  prompt = check_token_ids("prompt", prompt, target.config.vocab_size)
  if not prompt:
    raise RequestError("prompt is empty", "prompt")
  if len(prompt) + drafter.config.block_size > target.config.max_position_embeddings:
    raise RequestError(f"a prompt of {len(prompt)} tokens and a block of "
                       f"{drafter.config.block_size} exceed the model's "
                       f"{target.config.max_position_embeddings} positions", "prompt")
  state = decode.prefill(
      target.params, drafter.params, jnp.asarray([list(prompt)], jnp.int32),
      jnp.asarray([len(prompt)], jnp.int32), jax.random.key(0), tcfg=target.config,
      dcfg=drafter.config, lc=decode.LoopConfig(method="chain", max_new_tokens=2,
                                                num_drafts=drafter.config.num_drafts),
      capacity=len(prompt))
  return drafter_lib.draft_logits(drafter.params, drafter.config, target.params,
                                  state.draft_cache, state.bonus)[0]
