"""Shared plumbing of the config-driven scripts (generate, bench_matrix, coding_eval, draw_tree) and
the notebook: load and validate a config, build the models it names, make prompts, one step.

Validation gives one clear message naming the valid values (unknown keys, methods, budgets, ...):

  python -m experiments.bench_matrix --config=configs/bench_smoke.py --config.budget=8
  -> unknown config key 'budget'. Did you mean 'budgets'? Valid keys: attention, baselines, ...
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import importlib.util
import os
import sys
from typing import Any, Sequence

import ml_collections
import numpy as np

from ddtree_jax.request import MAX_BUDGET, GenerateOptions, RequestError
from ddtree_jax.speculative.decode import METHODS
from experiments.perf import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIN_BUDGET = 1
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")


class ConfigError(ValueError):
  """A bad config value or key; the message lists the valid values."""


# ------------------------------------------------------------------------------------------------
# Loading configs and checking keys


def load_config(spec: str = DEFAULT_CONFIG, overrides: Sequence[str] | dict = ()):
  """Loads `path.py[:arg]` (relative to the repo or the cwd) like --config does, then applies
  overrides ("key.sub=value" strings or a {dotted key: value} dict), checking every key."""
  path, _, arg = spec.partition(":")
  if not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
    path = os.path.join(REPO, path)
  if not os.path.exists(path):
    raise ConfigError(f"config file {path!r} does not exist; the configs are in "
                      f"{os.path.join(REPO, 'configs')}: {', '.join(_config_files())}")
  mod_spec = importlib.util.spec_from_file_location(
      "ddtree_config_" + os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  try:
    cfg = module.get_config(arg) if arg else module.get_config()
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config {spec!r}: {e}") from None
  items = overrides.items() if isinstance(overrides, dict) else (
      o.split("=", 1) for o in overrides)
  for key, value in items:
    check_key(cfg, key, where=spec)
    _set(cfg, key, value)
  return cfg


def _config_files():
  d = os.path.join(REPO, "configs")
  return sorted(f for f in os.listdir(d) if f.endswith(".py")) if os.path.isdir(d) else []


def leaf_keys(cfg, prefix: str = "") -> list[str]:
  """Every dotted key of a (nested) ConfigDict."""
  out = []
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      out += leaf_keys(v, f"{prefix}{k}.")
    else:
      out.append(prefix + k)
  return out


def check_key(cfg, dotted: str, where: str = "the config") -> None:
  """Raises ConfigError unless `dotted` names a field of cfg (nested dicts included)."""
  node = cfg
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      valid = leaf_keys(cfg)
      close = difflib.get_close_matches(dotted, valid, n=1)
      hint = f" Did you mean {close[0]!r}?" if close else ""
      raise ConfigError(f"unknown config key {dotted!r} in {where}.{hint} Valid keys: "
                        f"{', '.join(valid)}")
    node = node[part]


def _set(cfg, dotted: str, value: Any) -> None:
  *parents, last = dotted.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  old = node[last]
  if isinstance(value, str) and not isinstance(old, str):
    if isinstance(old, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"config key {dotted!r} is a bool; got {value!r} (use True or False)")
      value = value.lower() in ("true", "1")
    elif isinstance(old, (int, float)):
      try:
        value = type(old)(value)
      except ValueError:
        raise ConfigError(f"config key {dotted!r} is a {type(old).__name__}; got {value!r}") from None
    elif isinstance(old, tuple):
      value = tuple(v for v in value.split(",") if v)
  node[last] = value


def check_argv(argv: Sequence[str], flag: str = "config", default: str = DEFAULT_CONFIG) -> None:
  """Checks the --config.KEY=... overrides of a command line before absl parses them, so that a
  typo gives one clear line (valid keys listed) instead of a traceback."""
  spec, keys = default, []
  args = list(argv[1:])
  for i, a in enumerate(args):
    if a.startswith(f"--{flag}="):
      spec = a.split("=", 1)[1]
    elif a == f"--{flag}" and i + 1 < len(args):
      spec = args[i + 1]
    elif a.startswith(f"--{flag}."):
      keys.append(a[len(flag) + 3:].split("=", 1)[0])
  cfg = load_config(spec)  # a missing file or a bad ":arg" fails here, with a clear message
  for k in keys:
    check_key(cfg, k, where=spec)


def define_config(default: str = "configs/default.py", flag: str = "config"):
  """config_flags.DEFINE_config_file, after checking the command line's --config.KEY overrides
  (ml_collections applies them while defining the flag, with a traceback on a typo)."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from ddtree_jax import engine  # pylint: disable=import-outside-toplevel
  try:
    check_argv(sys.argv, flag, default)
  except ConfigError as e:
    sys.exit(f"error: {e}")
  engine.define_compilation_cache_flags()
  return config_flags.DEFINE_config_file(flag, default, "run configuration (a configs/*.py file)")


def run_app(main) -> None:
  """absl.app.run(main) with the persistent compilation cache on as the flags say; a bad config
  or request (ConfigError, request.RequestError, a CheckpointError) exits with its message only,
  no traceback."""
  from absl import app  # pylint: disable=import-outside-toplevel
  from ddtree_jax import engine
  from ddtree_jax.checkpoints.safetensors_io import CheckpointError  # pylint: disable=import-outside-toplevel

  def wrapped(argv):
    engine.compilation_cache_from_flags()
    try:
      return main(argv)
    except (ConfigError, RequestError, CheckpointError) as e:
      sys.exit(f"error: {e}")
  app.run(wrapped)


# ------------------------------------------------------------------------------------------------
# Validation of values


@dataclasses.dataclass(frozen=True)
class Plan:
  """The parsed, validated sweep of a config."""
  methods: tuple[str, ...]
  budgets: tuple[int | str, ...]             # "auto": budget="auto" over cfg.auto_budgets
  batches: tuple[int, ...]
  runs: tuple[tuple[str, int | str | None], ...]   # (method, budget or None) in run order
  profile: tuple[str, ...]                    # methods whose stages are timed

  @staticmethod
  def name(method: str, budget: int | None) -> str:
    return method if budget is None else f"{method}/B={budget}"


def _ints(value, what: str, lo: int, hi: int | None, valid: str) -> tuple[int, ...]:
  parts = [p.strip() for p in str(value).split(",") if p.strip()]
  out = []
  for p in parts:
    try:
      x = int(p)
    except ValueError:
      raise ConfigError(f"{what} {p!r} is not an integer; valid {what}s: {valid}") from None
    if x < lo or (hi is not None and x > hi):
      raise ConfigError(f"{what} {x} is out of range; valid {what}s: {valid}")
    out.append(x)
  return tuple(out)


def parse_methods(value) -> tuple[str, ...]:
  methods = tuple(m.strip() for m in str(value).split(",") if m.strip())
  bad = [m for m in methods if m not in METHODS]
  if bad or not methods:
    raise ConfigError(f"unknown method(s) {bad or value!r}; valid methods: {', '.join(METHODS)} "
                      "(comma list, e.g. --config.methods=ar,chain,ddtree)")
  return methods


def parse_budgets(value) -> tuple[int | str, ...]:
  """Budgets in [MIN_BUDGET, MAX_BUDGET] and "auto" (comma list)."""
  parts = [p.strip() for p in str(value).split(",") if p.strip()]
  ints = _ints(",".join(p for p in parts if p != "auto"), "budget", MIN_BUDGET, MAX_BUDGET,
               f"integers in [{MIN_BUDGET}, {MAX_BUDGET}] or auto (comma list, e.g. "
               "--config.budgets=8,32,auto)")
  it = iter(ints)
  return tuple("auto" if p == "auto" else next(it) for p in parts)


def validate(cfg, *, needs_drafter_for_spec: bool = True, baselines: bool | None = None) -> Plan:
  """Checks every value a script uses; returns the Plan. Raises ConfigError with valid values."""
  ref = load_config(DEFAULT_CONFIG)
  extra = sorted(set(leaf_keys(cfg)) - set(leaf_keys(ref)))
  if extra:
    raise ConfigError(f"unknown config key(s) {extra}; valid keys: {', '.join(leaf_keys(ref))}")
  methods = parse_methods(cfg.methods)
  budgets = parse_budgets(cfg.budgets) if "ddtree" in methods else ()
  if "ddtree" in methods and not budgets:
    raise ConfigError(f"method ddtree needs budgets: integers in [{MIN_BUDGET}, {MAX_BUDGET}]")
  batches = _ints(cfg.batches, "batch", 1, None, "integers >= 1 (comma list, e.g. 1,4,8)")
  if not batches:
    raise ConfigError("batches is empty; valid batches: integers >= 1 (comma list)")
  if cfg.dtype not in DTYPES:
    raise ConfigError(f"unknown dtype {cfg.dtype!r}; valid dtypes: {', '.join(DTYPES)}")
  for key, lo in (("repeats", 1), ("profile_repeats", 1), ("compile_threads", 1),
                  ("prompt_len", 0), ("topk_cap", 0), ("coding.max_new_tokens", 1),
                  ("coding.memory_mb", 16)):
    v = cfg
    for p in key.split("."):
      v = v[p]
    if not isinstance(v, int) or v < lo:
      raise ConfigError(f"{key} must be an integer >= {lo}, got {v!r}")
  try:  # the generate options, as the engine checks them
    generate_options(cfg, "ar", None).check_values()
  except RequestError as e:
    raise ConfigError(f"{e} (--config.{e.field})") from None
  if cfg.near_tie_eps < 0:
    raise ConfigError(f"near_tie_eps must be >= 0, got {cfg.near_tie_eps}")
  if cfg.coding.timeout_s <= 0:
    raise ConfigError(f"coding.timeout_s must be > 0, got {cfg.coding.timeout_s}")
  if not cfg.random_target and not os.path.exists(os.path.join(cfg.target, "config.json")):
    raise ConfigError(f"target {cfg.target!r} has no config.json: set --config.target=DIR (a "
                      "Hugging Face Qwen3/Llama folder; or the env var the config names) or "
                      "--config.random_target=True (random weights of config.shape)")
  if cfg.drafter and cfg.random_drafter:
    raise ConfigError(f"both drafter={cfg.drafter!r} and random_drafter=True are set; choose one")
  if cfg.drafter and not os.path.exists(os.path.join(cfg.drafter, "config.json")):
    raise ConfigError(f"drafter {cfg.drafter!r} has no config.json (a z-lab DFlash folder)")
  has_drafter = bool(cfg.drafter) or cfg.random_drafter
  if cfg.draft_vocab and not has_drafter:
    raise ConfigError(f"draft_vocab={cfg.draft_vocab!r} is set but there is no drafter")
  if cfg.draft_vocab and not os.path.isfile(cfg.draft_vocab):
    raise ConfigError(f"draft_vocab {cfg.draft_vocab!r}: no such .npy file of vocabulary ids")
  spec = [m for m in methods if m != "ar"]
  if spec and not has_drafter and needs_drafter_for_spec:
    raise ConfigError(f"methods {spec} need a drafter: set --config.drafter=DIR or "
                      "--config.random_drafter=True, or use --config.methods=ar")
  if cfg.shape.model_type not in ("qwen3", "llama"):
    raise ConfigError(f"shape.model_type {cfg.shape.model_type!r}; valid: qwen3, llama")
  baselines = cfg.baselines if baselines is None else baselines
  order = list(methods)
  if baselines:
    order = ["ar"] + (["chain"] if has_drafter else []) + order
  runs = []
  for m in METHODS:  # ar, chain, ddtree: the baselines first
    if m in order:
      runs += [(m, b) for b in budgets] if m == "ddtree" else [(m, None)]
  profile = str(cfg.profile).strip()
  if profile in ("", "none"):
    prof = ()
  elif profile == "all":
    prof = METHODS
  else:
    prof = parse_methods(profile)
  return Plan(methods=methods, budgets=budgets, batches=batches, runs=tuple(runs), profile=prof)


# ------------------------------------------------------------------------------------------------
# Models


def model_config_from_shape(shape):
  from ddtree_jax.models.config import ModelConfig  # pylint: disable=import-outside-toplevel
  return ModelConfig(
      model_type=shape.model_type, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
      intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
      num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
      rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
      qk_norm=shape.model_type == "qwen3", tie_word_embeddings=shape.tie_word_embeddings,
      max_position_embeddings=1 << 20)


def random_target(shape, dtype="bfloat16", seed: int = 0, mesh=None, fuse_qkv: bool = True):
  """A Target of random weights with the architecture `shape` (no tokenizer, no eos); on one
  device its q/k/v weights fused as `checkpoint.load_target` does (unless fuse_qkv=False)."""
  import jax  # pylint: disable=import-outside-toplevel
  from ddtree_jax import sharding
  from ddtree_jax.checkpoints import hf as checkpoint
  cfg = model_config_from_shape(shape)
  rules = sharding.DEFAULT_RULES if mesh is not None else None
  params = harness.random_target(cfg, jax.random.key(seed), mesh, fuse_qkv, rules,
                                 checkpoint.parse_dtype(dtype))
  return checkpoint.Target(params=params, config=cfg, tokenizer=None,
                           path=f"random:{shape.model_type}", mesh=mesh, rules=rules)


def random_drafter(target, shape, seed: int = 1, std: float = 0.02):
  """A random DFlash drafter (Qwen3-style layers, the target's width) for `target`."""
  import jax  # pylint: disable=import-outside-toplevel
  from ddtree_jax import sharding
  from ddtree_jax.checkpoints import dflash
  from ddtree_jax.models import drafter as drafter_lib  # pylint: disable=import-outside-toplevel
  tcfg = target.config
  lcfg = dataclasses.replace(tcfg, num_layers=shape.num_layers, model_type="qwen3", qk_norm=True)
  ids = tuple(int(x) for x in str(shape.target_layer_ids).split(",") if x.strip())
  if not ids:
    ids = drafter_lib.default_target_layer_ids(tcfg.num_layers, shape.num_layers)
    if not all(0 <= i < tcfg.num_layers for i in ids):  # tiny targets: spread over all layers
      n, top = shape.num_layers, tcfg.num_layers - 1
      ids = tuple(sorted({round(i * top / max(n - 1, 1)) for i in range(n)}))
  bad = [i for i in ids if not 0 <= i < tcfg.num_layers]
  if bad:
    raise ConfigError(f"drafter_shape.target_layer_ids {bad} out of range for a "
                      f"{tcfg.num_layers}-layer target; valid: 0..{tcfg.num_layers - 1}")
  mask = shape.mask_token_id if shape.mask_token_id >= 0 else tcfg.vocab_size - 1
  if not 0 <= mask < tcfg.vocab_size:
    raise ConfigError(f"drafter_shape.mask_token_id {mask} outside the vocab [0, "
                      f"{tcfg.vocab_size})")
  if shape.block_size < 2:
    raise ConfigError(f"drafter_shape.block_size must be >= 2, got {shape.block_size}")
  dcfg = drafter_lib.DrafterConfig(layers=lcfg, block_size=shape.block_size, mask_token_id=mask,
                                   target_layer_ids=ids)
  params = harness.random_drafter_params(tcfg, dcfg, jax.random.key(seed), target.dtype, std)
  params = sharding.shard_params(params, target.mesh, target.rules)
  return dflash.Drafter(params=params, config=dcfg, path="random")


def load_models(cfg, mesh=None):
  """(target, drafter or None) as the config names them (checkpoints or random weights)."""
  import ddtree_jax as dj  # pylint: disable=import-outside-toplevel
  if cfg.random_target:
    target = random_target(cfg.shape, cfg.dtype, cfg.seed, mesh)
  else:
    target = dj.load_target(cfg.target, dtype=cfg.dtype, mesh=mesh)
  vocab = cfg.draft_vocab or None
  drafter = None
  if cfg.drafter:
    drafter = dj.load_drafter(cfg.drafter, target, int8=cfg.drafter_int8, draft_vocab=vocab)
  elif cfg.random_drafter:
    from ddtree_jax.checkpoints import dflash  # pylint: disable=import-outside-toplevel
    drafter = random_drafter(target, cfg.drafter_shape, cfg.seed + 1, cfg.drafter_shape.init_std)
    drafter = dataclasses.replace(drafter, params=dflash.derive_drafter_params(
        drafter.params, target, int8=cfg.drafter_int8, draft_vocab=vocab))
  return target, drafter


# ------------------------------------------------------------------------------------------------
# Prompts


def encoder(target):
  """text -> token ids with the target's tokenizer (a byte fallback without one)."""
  tok = target.tokenizer
  if tok is not None:
    return lambda s: tok.encode(s).ids
  v = target.config.vocab_size
  return lambda s: [b % v for b in s.encode()] or [0]


def decoder(target):
  tok = target.tokenizer
  return (lambda ids: tok.decode(list(ids))) if tok is not None else (lambda ids: str(list(ids)))


def make_prompts(cfg, target, batch: int) -> list[list[int]]:
  """`batch` prompts: cfg.prompts cycled (encoded), or random tokens when cfg.prompt_len > 0 or
  the target has no tokenizer (random targets; 64 tokens unless prompt_len says otherwise)."""
  if cfg.prompt_len > 0 or target.tokenizer is None:
    n = cfg.prompt_len or 64
    rng = np.random.default_rng(cfg.seed)
    v = target.config.vocab_size
    return [rng.integers(0, v, n).tolist() for _ in range(batch)]
  enc = encoder(target)
  texts = list(cfg.prompts)
  if not texts:
    raise ConfigError("prompts is empty; give at least one prompt (or prompt_len > 0)")
  return [enc(texts[i % len(texts)]) for i in range(batch)]


def generate_options(cfg, method: str, budget: int | None) -> GenerateOptions:
  """The generate options of one run of the config (its "" and 0 are the options' None, its
  ignore_eos no stop ids)."""
  auto = {} if budget != "auto" else dict(
      budgets=_ints(cfg.auto_budgets, "auto budget", 0, MAX_BUDGET, "integers in "
                    f"[0, {MAX_BUDGET}] (comma list, 0 = AR)"),
      budget_costs=tuple(float(c) for c in str(cfg.budget_costs).split(",") if c.strip()) or None,
      auto_every=cfg.auto_every)
  return GenerateOptions(
      method=method, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
      seed=cfg.seed, budget=budget, **auto,
      topk_cap=(cfg.topk_cap or None) if method == "ddtree" else None,
      attention=cfg.attention or None, stop_token_ids=() if cfg.ignore_eos else None,
      steps_per_check=cfg.steps_per_check)


def auto_summary(res) -> dict:
  """A budget="auto" run in numbers (empty for others): steps per chosen budget ({budget:
  steps}, 0 = AR), and per step that verified a drafted budget the drafts accepted and those the
  drafter expected (mean over rows and steps)."""
  if "chosen" not in res.stats:
    return {}
  counts = collections.Counter(res.stats["chosen"])
  drafted = [(p, a - 1) for ps, acc in zip(res.stats["predicted"], res.stats["acceptance_lengths"])
             for p, a in zip(ps, acc) if p > 0]
  mean = lambda xs: float(np.mean(xs)) if xs else 0.0
  return {"chosen": {int(b): counts[b] for b in sorted(counts)},
          "expected_per_drafted_step": mean([p for p, _ in drafted]),
          "accepted_per_drafted_step": mean([a for _, a in drafted])}


def generate_kwargs(cfg, method: str, budget: int | None, drafter) -> dict:
  """Keyword arguments of dj.generate for one run of the config."""
  return dict(generate_options(cfg, method, budget).kwargs(),
              drafter=drafter if method != "ar" else None)


# ------------------------------------------------------------------------------------------------
# One speculative step, laid open (draw_tree, the notebook)


def one_step(target, drafter, prompt: Sequence[int], budget: int | None, method: str = "ddtree",
             attention: str = "xla", topk_cap: int | None = None) -> dict:
  """Prefill `prompt`, then draft -> tree -> verify -> accept once (greedy), via the engine's own
  stage functions. Returns numpy arrays: draft_logits [L, V] ([L, Vd] for a drafter with a
  draft vocabulary), the tree (unbatched), post (the target's argmax per node), path (accepted
  node ids, root first), tau, emitted tokens, bonus."""
  import jax  # pylint: disable=import-outside-toplevel
  from ddtree_jax import engine
  from ddtree_jax.speculative import decode
  from ddtree_jax.speculative import verify  # pylint: disable=import-outside-toplevel
  dcfg = drafter.config
  state, lc = engine.prefill_state(
      target, [list(prompt)], method=method, max_new_tokens=dcfg.num_drafts + 2,
      drafter=drafter, budget=budget if method == "ddtree" else None,
      topk_cap=topk_cap if method == "ddtree" else None, attention=attention,
      stop_token_ids=())
  logits = jax.jit(lambda dp, tp, st: decode.draft(dp, tp, dcfg, lc, st))(
      drafter.params, target.params, state)
  vocab = dcfg.vocab(drafter.params)
  tree = jax.jit(lambda lg, b, v: decode.make_tree(lc, lg, b, v))(logits, state.bonus, vocab)
  post, *_ = jax.jit(lambda tp, st, tr: decode.verify_and_pick(
      tp, target.config, dcfg, lc, st, tr, jax.random.key(0)))(target.params, state, tree)
  path, tau, emitted = verify.accept(tree.tokens, tree.parents, tree.depths, tree.visibility,
                                     post, dcfg.num_drafts)
  tau = int(tau[0])
  one = jax.tree.map(lambda x: np.asarray(x[0]), tree)
  return dict(draft_logits=np.asarray(logits[0]), tree=one, post=np.asarray(post[0]),
              path=np.asarray(path[0, :tau]), tau=tau, emitted=np.asarray(emitted[0, :tau]),
              bonus=int(state.bonus[0]))
