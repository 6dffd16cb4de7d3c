"""budget="auto": the budget of each step chosen on device from the draft's own expected acceptance
and each compiled budget's measured step time (docs/design.md §5).

DDTree's tree for budget B is the first B + 1 nodes of the tree for any larger budget (best-first
order, parents first), so one tree at the largest budget gives every candidate. Under the draft
a node's path is accepted with probability exp(score), the product of its tokens' draft
probabilities; the expected accepted drafts of budget B are the sum of that over its B nodes
(`expected_accepted`). Drafts are over-confident, so each row scales its expectation by the ratio
of the drafts it had accepted to those expected so far (`ratio`). A step then takes the option
of the most expected committed tokens per second over the live rows:

  value(B) = sum over live rows b of (1 + ratio_b E_b(B)) / cost(B)

with budget 0 for AR (the root alone: nothing drafted, E = 0). AR needs no draft, but the choice
needs one: after choosing AR the loop skips drafting for `skip` steps, a back-off that doubles
while AR keeps winning (up to MAX_BACKOFF), so a drafter that is never accepted costs one drafted
step in MAX_BACKOFF + 1. The drafter's context advances on AR steps too (the root's features are
committed as on any step), so drafting resumes where it stopped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MAX_BACKOFF = 32   # the longest run of AR steps before drafting again
PRIOR = 1.0        # pseudo-counts of the ratio: one expected draft, accepted


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AutoState:
  """The chooser's state in the decode loop: J options, B rows, M steps."""
  cost: jax.Array        # [J] float32: seconds per step of each option (the denominators)
  expected: jax.Array    # [B] float32: expected accepted drafts summed over drafted steps
  accepted: jax.Array    # [B] float32: accepted drafts over the same steps
  skip: jax.Array        # [] int32: AR steps left before the next draft
  backoff: jax.Array     # [] int32: the skip after the next AR choice
  chosen: jax.Array      # [M] int32: each step's budget (0: AR)
  predicted: jax.Array   # [M, B] float32: each step's expected accepted drafts (0 undrafted)

  @classmethod
  def init(cls, cost, batch: int, steps: int) -> AutoState:
    return cls(cost=jnp.asarray(cost, jnp.float32), expected=jnp.zeros((batch,), jnp.float32),
               accepted=jnp.zeros((batch,), jnp.float32), skip=jnp.zeros((), jnp.int32),
               backoff=jnp.ones((), jnp.int32), chosen=jnp.zeros((steps,), jnp.int32),
               predicted=jnp.zeros((steps, batch), jnp.float32))

  def partition_specs(self, axes) -> AutoState:
    bt = axes("batch", self.expected.shape[0], "batch")
    return AutoState(cost=P(), expected=P(bt), accepted=P(bt), skip=P(), backoff=P(),
                     chosen=P(), predicted=P(None, bt))


def expected_accepted(scores, budgets: tuple[int, ...]):
  """scores [B, N] (a best-first tree's log path probabilities under the draft, root first) ->
  [B, J]: the expected accepted drafts of the tree's first 1 + budgets[j] nodes."""
  cum = jnp.concatenate([jnp.zeros_like(scores[:, :1]),
                         jnp.cumsum(jnp.exp(scores[:, 1:].astype(jnp.float32)), axis=1)], axis=1)
  return cum[:, jnp.asarray(budgets)]


def ratio(auto: AutoState):
  """[B]: each row's accepted over expected drafts so far (with PRIOR pseudo-counts)."""
  return (auto.accepted + PRIOR) / (auto.expected + PRIOR)


def choose(auto: AutoState, expected, live):
  """The option of the most expected committed tokens per second over the live rows: expected
  [B, J] (`expected_accepted`), live [B] bool -> index j (int32)."""
  gain = jnp.sum(jnp.where(live[:, None], 1.0 + ratio(auto)[:, None] * expected, 0.0), axis=0)
  return jnp.argmax(gain / auto.cost).astype(jnp.int32)


def after_step(auto: AutoState, step, budget, predicted, accepted, live) -> AutoState:
  """The state after a step that chose `budget` (0: AR) with `predicted` [B] expected accepted
  drafts (0 when nothing was drafted), of which the live rows accepted `accepted` [B]: the
  ratio's sums (drafted steps only), the back-off (reset by a drafted budget, doubled by AR)."""
  drafted = budget > 0
  took = jnp.where(live & drafted, 1.0, 0.0)
  ar = budget == 0
  return dataclasses.replace(
      auto, expected=auto.expected + took * predicted,
      accepted=auto.accepted + took * accepted.astype(jnp.float32),
      skip=jnp.where(ar & (auto.skip == 0), auto.backoff, jnp.maximum(auto.skip - 1, 0)),
      backoff=jnp.where(ar, jnp.where(auto.skip == 0, jnp.minimum(2 * auto.backoff, MAX_BACKOFF),
                                      auto.backoff), 1),
      chosen=auto.chosen.at[step].set(budget),
      predicted=auto.predicted.at[step].set(jnp.where(live, predicted, 0.0)))


def forced(num_options: int, j: int):
  """A cost vector that makes `choose` pick option j whatever the draft (calibration)."""
  return jnp.full((num_options,), jnp.inf, jnp.float32).at[j].set(1.0)
