"""The decode loop: prefill, then one jitted step per static (method, budget, batch, capacity).

Every method is the same step with a different tree: AR verifies the root alone, chain verifies
[bonus, greedy drafts] causally, DDTree verifies the best `budget`-node tree. The loop runs in
`lax.while_loop` on device; the host sees the results once, at the end.

  draft -> build tree -> verify (one target forward) -> accept -> commit (target + drafter caches)

budget="auto" (`auto_step`, speculative/auto.py) builds the tree one budget above its last choice
and verifies the prefix of the budget it chooses, or drafts nothing and verifies the root alone;
with auto_every = K > 1 the K - 1 steps after each choosing step run the chosen budget's own
step (`auto_steps`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import decoder
from ddtree_jax import sharding
from ddtree_jax.speculative import auto as auto_lib
from ddtree_jax.speculative import tree as tree_lib
from ddtree_jax.speculative import verify
from ddtree_jax.kernels import Kernels

METHODS = ("ar", "chain", "ddtree")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Static settings of one compiled decode program (a request's: `request.GenerateOptions`'
  `loop_config`)."""
  method: str
  max_new_tokens: int
  num_drafts: int = 0             # L = drafter block size - 1 (0 for AR)
  budget: int = 0                 # non-root tree nodes (ddtree)
  topk_cap: int | None = None
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  stop_ids: tuple[int, ...] = ()
  kernels: Kernels = Kernels()    # attention / q-k / residual / embedding implementations, mesh
  steps_per_check: int = 1        # steps between two checks of the loop's stop condition
                                  # (each check is a host round trip; see decode_loop)
  budgets: tuple[int, ...] = ()   # budget="auto": the options (0 = AR), ascending; budget is
                                  # their largest (the tree built each drafted step)
  auto_every: int = 1             # budget="auto" chooses every this many steps (`auto_steps`)

  @property
  def mesh(self):
    return self.kernels.mesh

  @property
  def rules(self):
    return self.kernels.rules


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  cache: decoder.KVCache                   # target K/V of committed tokens
  draft_cache: decoder.KVCache | None      # drafter context K/V (same lens), None for AR
  bonus: jax.Array                       # [B] last emitted token, not yet in the cache
  out: jax.Array                         # [B, M] emitted tokens
  n_out: jax.Array                       # [B] tokens emitted so far
  done: jax.Array                        # [B] bool
  accepted: jax.Array                    # [M, B] tokens committed at each step (0 once done)
  step: jax.Array                        # [] int32
  key: jax.Array                         # PRNG key
  auto: auto_lib.AutoState | None = None # budget="auto"'s chooser, None otherwise

  def partition_specs(self, axes) -> DecodeState:
    """The caches by their own layout, the per-sequence fields over dp on their batch dim,
    step and key replicated."""
    def batch(x, dim):
      spec = [None] * x.ndim
      spec[dim] = axes("batch", x.shape[dim], "batch")
      return P(*spec)
    return DecodeState(
        cache=self.cache.partition_specs(axes),
        draft_cache=None if self.draft_cache is None else self.draft_cache.partition_specs(axes),
        bonus=batch(self.bonus, 0), out=batch(self.out, 0), n_out=batch(self.n_out, 0),
        done=batch(self.done, 0), accepted=batch(self.accepted, 1), step=P(),
        key=jax.tree.map(lambda _: P(), self.key),
        auto=None if self.auto is None else self.auto.partition_specs(axes))


def _root_tree(bonus):
  """AR: a tree of the root alone."""
  b = bonus.shape[0]
  return tree_lib.DraftTree(tokens=bonus[:, None].astype(jnp.int32),
                            parents=jnp.full((b, 1), -1, jnp.int32),
                            depths=jnp.zeros((b, 1), jnp.int32),
                            scores=jnp.zeros((b, 1), jnp.float32),
                            visibility=jnp.ones((b, 1, 1), bool))


def _stop_and_emit(lc: LoopConfig, state: DecodeState, emitted, tau):
  """How many of `emitted` [B, W] each sequence keeps: tau, cut at max_new_tokens and after the
  first stop token. Returns (count [B], hit_stop [B])."""
  r = jnp.arange(emitted.shape[1])[None]
  count = jnp.where(state.done, 0, jnp.minimum(tau, lc.max_new_tokens - state.n_out))
  if not lc.stop_ids:
    return count, jnp.zeros_like(state.done)
  is_stop = jnp.isin(emitted, jnp.asarray(lc.stop_ids, jnp.int32)) & (r < count[:, None])
  hit = jnp.any(is_stop, axis=1)
  return jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, count).astype(jnp.int32), hit


def _advance(lc, dparams, dcfg, state, pending, taps, src, emitted, tau, key):
  """Commits `count` rows (src [B, W] of the verified block) and emits their tokens."""
  count, hit = _stop_and_emit(lc, state, emitted, tau)
  draft_cache = state.draft_cache
  if draft_cache is not None:  # the drafter gets the committed nodes' features, root included
    rows = jnp.take_along_axis(taps, src[:, :, None], axis=1)
    pos = draft_cache.lens[:, None] + jnp.arange(src.shape[1], dtype=jnp.int32)[None]
    dk, dv = dcfg.context(dparams, rows, pos)
    ident = jnp.broadcast_to(jnp.arange(src.shape[1], dtype=jnp.int32), src.shape)
    draft_cache = decoder.commit(draft_cache, decoder.Pending(dk, dv), ident, count)
  cache = decoder.commit(state.cache, pending, src, count)
  b, w = emitted.shape
  r = jnp.arange(w, dtype=jnp.int32)[None]
  dst = jnp.where(r < count[:, None], state.n_out[:, None] + r, lc.max_new_tokens)
  out = state.out.at[jnp.arange(b)[:, None], dst].set(emitted, mode="drop")
  last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  n_out = state.n_out + count
  return dataclasses.replace(
      state, cache=cache, draft_cache=draft_cache,
      bonus=jnp.where(count > 0, last, state.bonus), out=out, n_out=n_out,
      done=state.done | hit | (n_out >= lc.max_new_tokens),
      # a step of sequences that are all done (steps_per_check > 1) commits nothing, not counted
      accepted=state.accepted.at[state.step].set(count),
      step=state.step + jnp.any(~state.done).astype(jnp.int32), key=key)


def make_tree(lc: LoopConfig, draft_logits, bonus, draft_vocab=None):
  """The tree each method verifies: the root alone (AR), the greedy chain, or the DDTree tree.

  draft_vocab [Vd]: the drafter's logits cover these vocabulary ids only
  (`drafter.restrict_vocab`); the drafted nodes' tokens are mapped back to vocabulary ids."""
  if lc.method == "ar":
    return _root_tree(bonus)
  if lc.method == "chain":
    tree = tree_lib.chain_tree(draft_logits, bonus)
  else:
    tree = tree_lib.build_tree(draft_logits, lc.budget, lc.topk_cap, root_token=bonus,
                               vocab_top=lc.kernels.vocab_top_k)
  if draft_vocab is None:
    return tree
  root, drafted = tree.tokens[..., :1], tree.tokens[..., 1:]  # the root is the bonus, an id
  return dataclasses.replace(tree, tokens=jnp.concatenate([root, draft_vocab[drafted]], axis=-1))


def draft(dparams, tparams, dcfg, lc: LoopConfig, state: DecodeState):
  """The drafter's logits [B, L, V] (or [B, L, Vd]) for the block after each bonus."""
  return dcfg.draft(dparams, tparams, state.draft_cache, state.bonus, lc.kernels.outside_verify)


def verify_and_pick(tparams, tcfg, dcfg, lc: LoopConfig, state: DecodeState, tree, key,
                    pick=None):
  """Target forward over the tree; the target's choice (argmax or sample) at every node:
  pick(logits [B, N, V], key) -> [B, N], by default `verify.pick` with lc's settings."""
  taps_at = () if dcfg is None else dcfg.target_layer_ids
  logits, pending, taps = verify.verify_tree(tparams, tcfg, state.cache, tree.tokens,
                                             tree.depths, tree.visibility, taps_at, lc.kernels)
  if pick is None:
    pick = lambda x, k: verify.pick(x, lc.temperature, k, lc.top_k, lc.top_p)
  return pick(logits, key), pending, taps


def accept_and_commit(dparams, dcfg, lc: LoopConfig, state, tree, post, pending, taps, key):
  path, tau, emitted = verify.accept(tree.tokens, tree.parents, tree.depths, tree.visibility,
                                     post, lc.num_drafts)
  return _advance(lc, dparams, dcfg, state, pending, taps, path, emitted, tau, key)


def _split_key(key):
  """(next key, pick key) of the state's key, or of each row's key when it holds one per row."""
  if key.ndim == 0:
    return tuple(jax.random.split(key))
  keys = jax.vmap(jax.random.split)(key)
  return keys[:, 0], keys[:, 1]


def step(tparams, tcfg, dparams, dcfg, lc: LoopConfig, state: DecodeState,
         pick=None) -> DecodeState:
  """One speculative step for every sequence of the batch; `pick` as `verify_and_pick`'s (the
  slot engine's picks each row with its own settings and key)."""
  if lc.budgets:
    return auto_steps(tparams, tcfg, dparams, dcfg, lc, state, pick)
  key, pick_key = _split_key(state.key)
  logits = None
  if lc.method != "ar":
    with jax.named_scope("draft"):  # scopes name the stages in profiles (profile_step.py)
      logits = draft(dparams, tparams, dcfg, lc, state)
  with jax.named_scope("tree"):
    tree = make_tree(lc, logits, state.bonus, None if dcfg is None else dcfg.vocab(dparams))
  with jax.named_scope("verify"):
    post, pending, taps = verify_and_pick(tparams, tcfg, dcfg, lc, state, tree, pick_key, pick)
  with jax.named_scope("accept_commit"):
    return accept_and_commit(dparams, dcfg, lc, state, tree, post, pending, taps, key)


def auto_step(tparams, tcfg, dparams, dcfg, lc: LoopConfig, state: DecodeState,
              pick=None) -> DecodeState:
  """`step` with budget="auto": while backing off, verify the root alone without drafting; else
  draft, build the tree at the tier's budget (one above the last choice), verify the prefix of
  the budget up to it of the most expected tokens per second (`auto.choose`), and back off when
  AR (budget 0, if among lc.budgets) would be worth more (`auto.ar_wins`). An undrafted step
  holds its root's features for the drafter's context (`auto.hold`, unless auto_every > 1); the
  next drafted step commits them before it drafts."""
  key, pick_key = _split_key(state.key)
  auto, live = state.auto, ~state.done

  has_ar = int(lc.budgets[0] == 0)  # options 0.. : AR (if any), then the drafted budgets
  drafted_budgets = lc.budgets[has_ar:]

  if auto.holds:  # a step about to draft first commits the features undrafted steps held
    state = jax.lax.cond((auto.skip == 0) & jnp.any(auto.held > 0),
                         lambda s: _commit_held(dparams, dcfg, s), lambda s: s, state)
    auto = state.auto

  def verify_commit(tree, budget, predicted, back_off, tier=None, held=False):
    post, pending, taps = verify_and_pick(tparams, tcfg, dcfg, lc, state, tree, pick_key, pick)
    path, tau, emitted = verify.accept(tree.tokens, tree.parents, tree.depths, tree.visibility,
                                       post, lc.num_drafts)
    base = dataclasses.replace(state, draft_cache=None) if held else state
    new = _advance(lc, dparams, dcfg, base, pending, taps, path, emitted, tau, key)
    now = auto
    if held:  # the root's features wait for the next drafted step (auto.hold)
      new = dataclasses.replace(new, draft_cache=state.draft_cache)
      now = auto_lib.hold(auto, taps[:, 0], new.n_out - state.n_out)
    return dataclasses.replace(new, auto=auto_lib.after_step(
        now, state.step, jnp.int32(budget), predicted, tau - 1, live, back_off, tier))

  def root_only(_):
    return verify_commit(_root_tree(state.bonus), 0, jnp.zeros_like(auto.expected), False,
                         held=auto.holds)

  def tier(t, logits):
    """The step with the tree of drafted_budgets[t]: options up to it."""
    def run():
      with jax.named_scope("tree"):
        tree = make_tree(dataclasses.replace(lc, budget=drafted_budgets[t]), logits,
                         state.bonus, dcfg.vocab(dparams))
      expected = auto_lib.expected_accepted(tree.scores, lc.budgets[:has_ar + t + 1])
      j, back_off, next_tier = auto_lib.decide(auto, expected, live, t, has_ar,
                                               len(drafted_budgets))
      option = lambda i, b: lambda: verify_commit(
          tree_lib.prefix(tree, b + 1), b, expected[:, has_ar + i], back_off, next_tier)
      return jax.lax.switch(j, [option(i, b) for i, b in enumerate(drafted_budgets[:t + 1])])
    return run

  def drafted(_):
    with jax.named_scope("draft"):
      logits = draft(dparams, tparams, dcfg, lc, state)
    return jax.lax.switch(auto.tier, [tier(t, logits) for t in range(len(drafted_budgets))])

  return jax.lax.cond(auto.skip > 0, root_only, drafted, None) if has_ar else drafted(None)


def _commit_held(dparams, dcfg, state: DecodeState) -> DecodeState:
  """The features that undrafted steps held (`auto_lib.hold`) committed to the drafter's context
  in one pass, at the positions after its committed rows."""
  auto, cache = state.auto, state.draft_cache
  b, w = auto.held.shape[0], auto.held_taps.shape[1]
  at = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
  dk, dv = dcfg.context(dparams, auto.held_taps, cache.lens[:, None] + at)
  cache = decoder.commit(cache, decoder.Pending(dk, dv), at, auto.held)
  return dataclasses.replace(state, draft_cache=cache, auto=dataclasses.replace(
      auto, held=jnp.zeros_like(auto.held)))


def auto_steps(tparams, tcfg, dparams, dcfg, lc: LoopConfig, state: DecodeState,
               pick=None) -> DecodeState:
  """budget="auto" over lc.auto_every = K steps: one `auto_step` (which chooses), then K - 1 steps
  of the budget it ran, or of AR when it decided to back off, each that option's own step (no
  tree above it, no switch, no bookkeeping: on a launch-bound device the chooser's kernels are
  paid once per K steps). Those steps are recorded as chosen and count down a back-off; the
  ratio learns from the choosing steps only."""
  first = state.step
  state = auto_step(tparams, tcfg, dparams, dcfg, lc, state, pick)
  if lc.auto_every == 1:
    return state
  ran = jnp.where(state.auto.skip > 0, 0, state.auto.chosen[first])  # skip > 0: AR is an option
  fixed = lambda b: dataclasses.replace(lc, budgets=(), budget=b, method="ddtree" if b else "ar")
  run = lambda b: lambda s: jax.lax.fori_loop(
      0, lc.auto_every - 1, lambda _, s: step(tparams, tcfg, dparams, dcfg, fixed(b), s, pick), s)
  index = jnp.argmax(jnp.asarray(lc.budgets) == ran)
  after = jax.lax.switch(index, [run(b) for b in lc.budgets], state)
  auto, done = after.auto, after.step - state.step          # steps that emitted
  rows = state.step + jnp.arange(lc.auto_every - 1)
  rows = jnp.where(jnp.arange(lc.auto_every - 1) < done, rows, auto.chosen.shape[0])
  auto = dataclasses.replace(auto, chosen=auto.chosen.at[rows].set(ran, mode="drop"),
                             skip=jnp.maximum(auto.skip - done, 0))
  return dataclasses.replace(after, auto=auto)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc", "capacity"))
def prefill(tparams, dparams, tokens, lens, key, cost=None, *, tcfg, dcfg, lc: LoopConfig,
            capacity: int):
  """Prompts [B, T] (right-padded, true lengths `lens`) -> the initial DecodeState; cost [J]:
  budget="auto"'s seconds per step of each of lc.budgets."""
  pick = lambda logits, k: verify.pick(logits, lc.temperature, k, lc.top_k, lc.top_p)
  return prefill_with(pick, tparams, dparams, tokens, lens, key, cost, tcfg=tcfg, dcfg=dcfg,
                      lc=lc, capacity=capacity)


def prefill_with(pick, tparams, dparams, tokens, lens, key, cost=None, *, tcfg, dcfg,
                 lc: LoopConfig, capacity: int):
  """`prefill` (not jitted) with the first token pick(logits [B, V], key) -> [B] int32."""
  b, t = tokens.shape
  cache = decoder.init_target_cache(tcfg, b, capacity, tparams.embed.dtype)
  cache = sharding.constrain(cache, lc.mesh, lc.rules)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  taps_at = () if dcfg is None else dcfg.target_layer_ids
  hidden, pending, taps = decoder.forward(tparams, tcfg, tokens, positions, cache,
                                          decoder.causal_mask(lens, t), taps_at,
                                          lc.kernels.outside_verify, chain=True)
  cache = decoder.commit(cache, pending, positions, lens)
  draft_cache = None
  if dcfg is not None:
    dl = dcfg.layers
    dk, dv = dcfg.context(dparams, taps, positions)
    draft_cache = decoder.init_cache(dl.num_layers, b, dl.num_kv_heads, capacity, dl.head_dim,
                                   dk[0].dtype)
    draft_cache = sharding.constrain(draft_cache, lc.mesh, lc.rules)
    draft_cache = decoder.commit(draft_cache, decoder.Pending(dk, dv), positions, lens)
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
  key, pick_key = jax.random.split(key)
  first = pick(decoder.lm_head(tparams, last), pick_key)
  m = lc.max_new_tokens
  done = jnp.isin(first, jnp.asarray(lc.stop_ids, jnp.int32)) | (m <= 1)
  state = DecodeState(
      cache=cache, draft_cache=draft_cache, bonus=first,
      out=jnp.zeros((b, m), jnp.int32).at[:, 0].set(first), n_out=jnp.ones((b,), jnp.int32),
      done=done, accepted=jnp.zeros((m, b), jnp.int32), step=jnp.zeros((), jnp.int32), key=key,
      auto=auto_lib.AutoState.init(
          jnp.ones(len(lc.budgets)) if cost is None else cost, b, m,
          sum(x > 0 for x in lc.budgets),
          # undrafted steps hold their features when every step is auto_step's
          taps_dim=taps.shape[-1] if dcfg is not None and lc.auto_every == 1 else 0,
          taps_dtype=taps.dtype if dcfg is not None else jnp.float32)
      if lc.budgets else None)
  return sharding.constrain(state, lc.mesh, lc.rules)


# XLA:GPU records the loop body into CUDA graphs. XLA's default (LHS) chains every kernel after the
# one before it; CONCURRENT links each kernel only to the kernels whose buffers it needs, so
# independent kernels overlap (docs/findings/host-loop-and-cuda-graphs.md). CPU backends
# ignore it; `.compile(compiler_options=...)` overrides it.
LOOP_COMPILER_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "lc"), donate_argnames=("state",),
                   compiler_options=LOOP_COMPILER_OPTIONS)
def decode_loop(tparams, dparams, state, *, tcfg, dcfg, lc: LoopConfig):
  """Steps until every sequence is done, all inside one `lax.while_loop`.

  XLA:GPU evaluates a while loop's condition on the host: each iteration copies the predicate
  back and waits for it, so the device idles until the host launches the next iteration
  (docs/findings/host-loop-and-cuda-graphs.md). With lc.steps_per_check = K > 1 an
  iteration runs K steps as a fixed-trip loop (no check between them): one round trip per K
  steps, and up to K - 1 steps at the end compute for sequences that are all done (they commit
  nothing and are not counted)."""
  max_steps = max(lc.max_new_tokens - 1, 0)  # every active step emits at least one token
  cond = lambda s: (s.step < max_steps) & ~jnp.all(s.done)
  one = lambda s: sharding.constrain(step(tparams, tcfg, dparams, dcfg, lc, s), lc.mesh,
                                     lc.rules)
  body = one
  if lc.steps_per_check > 1:
    body = lambda s: jax.lax.fori_loop(0, lc.steps_per_check, lambda _, s: one(s), s)
  return jax.lax.while_loop(cond, body, state)
