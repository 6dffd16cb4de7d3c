"""budget="auto": the budget of each step chosen on device from the draft's own expected acceptance
and each compiled budget's measured step time (docs/design.md §5).

DDTree's tree for budget B is the first B + 1 nodes of the tree for any larger budget (best-first
order, parents first), so one tree gives every budget up to its own. A drafted step builds the
tree one budget above the last one chosen (the `tier`; the largest drafted budget at first, so
the first choice sees every option rather than climbing to the best a budget per step), so a
step pays for the tree it may use while the choice can still climb a budget per step. Under the
draft a node's path is accepted with probability exp(score), the product of its tokens' draft
probabilities; the expected accepted drafts of budget B are the sum of that over its B nodes
(`expected_accepted`). Drafts are over-confident, so each row scales its expectation by the ratio
of the drafts it had accepted to those expected so far (`ratio`). A step then takes the option
of the most expected committed tokens per second over the live rows:

  value(B) = sum over live rows b of (1 + ratio_b E_b(B)) / cost(B)

with budget 0 for AR (the root alone, E = 0). AR needs no draft, but the choice needs one, and a
drafted step verifies the best drafted budget whatever it decides (the draft is paid for, and
only a verified tree tells the ratio how the draft fares). When AR wins the comparison (and a
bigger tree would not change it: the choice is below the tree's budget, or the tree is the
largest), the next `skip` steps verify the root alone without drafting: as many steps as the cheapest drafted
budget costs AR steps, times a back-off that doubles while AR keeps winning (up to MAX_BACKOFF),
so a drafter that is never accepted costs about one drafted step's extra time in MAX_BACKOFF
steps. Those steps hold the root's target features (`held_taps`) instead of running the
drafter's context projection each step (its kernels would cost an undrafted step more than AR's
own on a launch-bound device); the next drafted step commits them in one pass before it drafts,
so drafting resumes where it stopped. A back-off skips at most HELD steps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MAX_BACKOFF = 32   # the longest run of AR steps before drafting again, in units of a drafted
                   # step's cost in AR steps
HELD = 128         # the most undrafted steps whose features wait for the drafter's context
PRIOR = 1.0        # pseudo-counts of the ratio: one expected draft, accepted


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AutoState:
  """The chooser's state in the decode loop: J options, B rows, M steps."""
  cost: jax.Array        # [J] float32: seconds per step of each option (the denominators)
  expected: jax.Array    # [B] float32: expected accepted drafts summed over drafted steps
  accepted: jax.Array    # [B] float32: accepted drafts over the same steps
  skip: jax.Array        # [] int32: AR steps left before the next draft
  backoff: jax.Array     # [] int32: the next skip, in units of a drafted step's cost in AR steps
  chosen: jax.Array      # [M] int32: each step's budget (0: AR)
  predicted: jax.Array   # [M, B] float32: each step's expected accepted drafts (0 undrafted)
  tier: jax.Array        # [] int32: which drafted budget the next drafted step's tree has
  held_taps: jax.Array   # [B, HELD, D]: target features of undrafted steps, not yet in the
                         # drafter's context (D = 0: none held, each step commits its own)
  held: jax.Array        # [B] int32: how many of them each row holds

  @classmethod
  def init(cls, cost, batch: int, steps: int, drafted: int, taps_dim: int = 0,
           taps_dtype=jnp.float32) -> AutoState:
    """`drafted` budgets above 0 among the options; the first tree has the largest (its choice
    weighs every option; later trees are one budget above the last choice). taps_dim: the
    drafter's feature width, when undrafted steps hold their features (`hold`)."""
    return cls(cost=jnp.asarray(cost, jnp.float32), expected=jnp.zeros((batch,), jnp.float32),
               accepted=jnp.zeros((batch,), jnp.float32), skip=jnp.zeros((), jnp.int32),
               backoff=jnp.ones((), jnp.int32), chosen=jnp.zeros((steps,), jnp.int32),
               predicted=jnp.zeros((steps, batch), jnp.float32),
               tier=jnp.asarray(max(drafted - 1, 0), jnp.int32),
               held_taps=jnp.zeros((batch, HELD if taps_dim else 0, taps_dim), taps_dtype),
               held=jnp.zeros((batch,), jnp.int32))

  def partition_specs(self, axes) -> AutoState:
    bt = axes("batch", self.expected.shape[0], "batch")
    return AutoState(cost=P(), expected=P(bt), accepted=P(bt), skip=P(), backoff=P(),
                     chosen=P(), predicted=P(None, bt), tier=P(), held_taps=P(bt, None, None),
                     held=P(bt))

  @property
  def holds(self) -> bool:
    """Whether undrafted steps hold their features (static)."""
    return self.held_taps.shape[1] > 0


def hold(auto: AutoState, taps, count) -> AutoState:
  """An undrafted step's root features taps [B, D] appended to each row that committed it
  (count [B]: 1, or 0 for a row that is done)."""
  b = taps.shape[0]
  at = jnp.where(count > 0, auto.held, HELD)  # out of range: dropped
  held_taps = auto.held_taps.at[jnp.arange(b), at].set(taps.astype(auto.held_taps.dtype),
                                                       mode="drop")
  return dataclasses.replace(auto, held_taps=held_taps, held=auto.held + (count > 0))


def expected_accepted(scores, budgets: tuple[int, ...]):
  """scores [B, N] (a best-first tree's log path probabilities under the draft, root first) ->
  [B, J]: the expected accepted drafts of the tree's first 1 + budgets[j] nodes."""
  cum = jnp.concatenate([jnp.zeros_like(scores[:, :1]),
                         jnp.cumsum(jnp.exp(scores[:, 1:].astype(jnp.float32)), axis=1)], axis=1)
  return cum[:, jnp.asarray(budgets)]


def ratio(auto: AutoState):
  """[B]: each row's accepted over expected drafts so far (with PRIOR pseudo-counts)."""
  return (auto.accepted + PRIOR) / (auto.expected + PRIOR)


def values(auto: AutoState, expected, live):
  """[J]: each option's expected committed tokens per second over the live rows (expected [B, J],
  `expected_accepted`; live [B] bool)."""
  gain = jnp.sum(jnp.where(live[:, None], 1.0 + ratio(auto)[:, None] * expected, 0.0), axis=0)
  return gain / auto.cost


def choose(auto: AutoState, expected, live, first: int = 0):
  """The option of the most expected committed tokens per second among options first.. (index
  j, int32; first = 1 leaves out AR, option 0 when budgets hold it)."""
  return (first + jnp.argmax(values(auto, expected, live)[first:])).astype(jnp.int32)


def ar_wins(auto: AutoState, expected, live):
  """Whether AR (option 0) is worth more than every drafted budget."""
  v = values(auto, expected, live)
  return v[0] > jnp.max(v[1:])


def decide(auto: AutoState, expected, live, tier: int, has_ar: int, drafted: int):
  """A drafted step's decision from a tree of drafted budget `tier` (static; options up to it):
  expected [B, has_ar + tier + 1] (`expected_accepted`), has_ar: whether option 0 is AR,
  drafted: how many drafted budgets there are -> (i: the drafted budget to verify, an index
  among the drafted ones; back_off: whether to skip drafting next; the next step's tier). AR is
  never verified at a drafted step (the draft is paid for, and only a verified tree tells the
  ratio how the draft fares); the back-off waits for the evidence of the largest tree the choice
  could reach: the choice is below the tree's budget, or the tree is the largest."""
  sub = dataclasses.replace(auto, cost=auto.cost[:has_ar + tier + 1])
  i = choose(sub, expected, live, first=has_ar) - has_ar
  back_off = jnp.zeros((), bool)
  if has_ar:
    back_off = ar_wins(sub, expected, live) & ((i < tier) | (tier == drafted - 1))
  return i, back_off, jnp.minimum(i + 1, drafted - 1)


def after_step(auto: AutoState, step, budget, predicted, accepted, live, back_off,
               tier=None) -> AutoState:
  """The state after a step that verified `budget` (0: the root alone, undrafted) with
  `predicted` [B] expected accepted drafts, of which the live rows accepted `accepted` [B]: the
  ratio's sums (drafted steps only), the back-off: back_off (AR won at this drafted step) skips
  the next steps, backoff x the cheapest drafted budget's cost in AR steps, and doubles
  `backoff`; a drafted step that AR did not win resets it. tier: the next drafted step's tree
  (None: as it was)."""
  drafted = budget > 0
  took = jnp.where(live & drafted, 1.0, 0.0)
  unit = jnp.ceil(jnp.min(auto.cost[1:]) / auto.cost[0]).astype(jnp.int32)
  skip = jnp.where(drafted, jnp.where(back_off, jnp.minimum(auto.backoff * jnp.maximum(unit, 1),
                                                           HELD), 0),
                   jnp.maximum(auto.skip - 1, 0))
  backoff = jnp.where(drafted, jnp.where(back_off, jnp.minimum(2 * auto.backoff, MAX_BACKOFF), 1),
                      auto.backoff)
  return dataclasses.replace(
      auto, expected=auto.expected + took * predicted,
      accepted=auto.accepted + took * accepted.astype(jnp.float32), skip=skip, backoff=backoff,
      tier=auto.tier if tier is None else jnp.asarray(tier, jnp.int32),
      chosen=auto.chosen.at[step].set(budget),
      predicted=auto.predicted.at[step].set(jnp.where(live, predicted, 0.0)))


def forced(num_options: int, j: int):
  """A cost vector that makes `choose` pick option j whatever the draft (calibration)."""
  return jnp.full((num_options,), jnp.inf, jnp.float32).at[j].set(1.0)
