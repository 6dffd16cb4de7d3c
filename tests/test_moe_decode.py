"""The MoE decode kernel (`pallas.moe_decode`, interpret mode on CPU): its in-kernel top-k against
`moe.select` (ties, padded lanes, both scorings), the layer against `moe.reference` for float,
int4 and fp8 stacks, routed or over given experts (elsewhere pairs), `Kernels.moe` choosing it at
decode rows only, and its Triton lowering for an abstract H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import kernels
from ddtree_jax.models import moe
from ddtree_jax.pallas import moe_decode
from helpers import abstract_h200_mesh, assert_close_rel, triton_custom_calls, verify_triton_ir

F32, BF16 = jnp.float32, jnp.bfloat16
H, E, I = 256, 12, 256   # int4 needs K steps of 128 inputs; 12 experts pad to 16 lanes
LAUNCH = dict(gate_up_block=16, block_k=128, down_blocks=(16, 32, 128))
ROUTINGS = [moe.Routing(3, norm_topk_prob=True),
            moe.Routing(2, norm_topk_prob=True, scoring="sigmoid", scaling=2.5),
            moe.Routing(4)]


def _layer(fmt="float", routing=ROUTINGS[0], seed=0, rows=3):
  key = jax.random.key(seed)
  params = moe.init_params(key, H, E, I, F32, std=0.3, bias=routing.scoring == "sigmoid",
                           experts=fmt)
  return params, jax.random.normal(jax.random.fold_in(key, 1), (rows, H), F32)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_choose_equals_select_with_ties_and_padded_lanes(routing):
  """One row at a time over 16 lanes (12 experts, 4 padded with -inf): the same experts in the
  same order and the same weights as `moe.select`, including logits tied exactly (the lower id
  first) and a bias that changes the choice but not the weights."""
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(6, E)).astype(np.float32)
  logits[:, 5] = logits[:, 2]              # ties: 2 before 5
  logits[0, :] = 0.25                      # a row of equal logits: ids 0, 1, 2, ...
  bias = (rng.normal(size=E) if routing.scoring == "sigmoid" else np.zeros(E)).astype(np.float32)
  bias_arg = jnp.asarray(bias) if routing.scoring == "sigmoid" else None
  want_w, want_e = moe.select(jnp.asarray(logits), bias_arg, routing, F32)
  pad = lambda v, fill: np.concatenate([v, np.full(16 - E, fill, np.float32)])
  for r in range(logits.shape[0]):
    experts, weights = moe_decode.choose(jnp.asarray(pad(logits[r], -np.inf)),
                                         None if bias_arg is None else jnp.asarray(pad(bias, 0)),
                                         routing, F32)
    assert [int(e) for e in experts] == np.asarray(want_e[r]).tolist()
    np.testing.assert_allclose([float(w) for w in weights], np.asarray(want_w[r]), rtol=1e-6)
  if bias_arg is None:  # (a bias breaks the equal row's ties)
    assert np.asarray(want_e[0]).tolist() == list(range(routing.top_k))


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("routing", ROUTINGS[:2], ids=["softmax", "sigmoid"])
def test_routed_layer_equals_reference(fmt, routing):
  """Routed inside the kernel, one row and three: the reference's mixture on the same stacks
  (dequantized), so a wrong expert, weight, row or rank changes the output."""
  params, x = _layer(fmt, routing)
  for rows in (1, 3):
    w, ex = moe.route(params, x[:rows], routing)
    assert_close_rel(moe_decode.moe_decode(params, x[:rows], routing, **LAUNCH),
                     moe.reference(params, x[:rows], w, ex), 1e-5)


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_given_experts_with_elsewhere_pairs(fmt):
  """Experts given (expert parallelism's local ids): pairs whose id is E add nothing."""
  routing = ROUTINGS[0]
  params, x = _layer(fmt, routing)
  w, ex = moe.route(params, x, routing)
  ex = ex.at[0, 0].set(E).at[2, 1].set(E).at[1].set(E)   # a whole row elsewhere too
  got = moe_decode.moe_decode(params, x, routing, w, ex, **LAUNCH)
  assert_close_rel(got, moe.reference(params, x, w, ex), 1e-5)
  assert np.all(np.asarray(got)[1] == 0)


def test_tied_router_columns_pick_the_lower_expert():
  """An unchosen expert given the router column of row 0's last-ranked one ties with it for the
  last place: the kernel must run the lower id (the two experts differ, so the higher one gives
  another output)."""
  routing = ROUTINGS[0]
  params, x = _layer("float", routing, seed=4, rows=1)
  _, ex = moe.route(params, x, routing)
  last = int(ex[0, -1])
  other = next(u for u in range(E) if u not in np.asarray(ex[0]).tolist())
  lo, hi = min(last, other), max(last, other)
  params = moe.MoEParams(params.router.at[:, other].set(params.router[:, last]),
                         params.w_gate_up, params.w_down)
  w, ex = moe.route(params, x, routing)
  assert int(ex[0, -1]) == lo and hi not in np.asarray(ex[0]).tolist()
  want, wrong = moe.reference(params, x, w, ex), moe.reference(params, x, w, ex.at[0, -1].set(hi))
  assert_close_rel(moe_decode.moe_decode(params, x, routing, **LAUNCH), want, 1e-5)
  assert np.max(np.abs(np.asarray(want - wrong))) > 1e-4 * np.max(np.abs(np.asarray(want)))


def test_group_limited_routing_is_chosen_outside_the_kernel():
  """DeepSeek-V3's group-limited top-k (n_group > 1) goes through `moe.select`."""
  routing = moe.Routing(2, norm_topk_prob=True, scoring="sigmoid", n_group=3, topk_group=2)
  params, x = _layer("float", routing)
  w, ex = moe.route(params, x, routing)
  assert_close_rel(moe_decode.moe_decode(params, x, routing, **LAUNCH),
                   moe.reference(params, x, w, ex), 1e-5)


def test_kernels_run_it_at_decode_rows_only():
  """Kernels("pallas").moe: up to moe_decode_max pairs the decode kernel (one pallas_call named
  moe_decode_gate_up in the program), above it the sorted pairs; both equal the reference."""
  routing = ROUTINGS[0]
  params, x = _layer("float", routing, rows=4)
  tuning = kernels.KernelTuning(moe_decode_max=9, moe_decode_launch=(16, 128, 4),
                                moe_pair_blocks=(16, 32, 128))
  layer = kernels.Kernels("pallas", tuning=tuning).moe
  for rows, decode in ((1, True), (3, True), (4, False)):
    jaxpr = str(jax.make_jaxpr(lambda p, x: layer(p, x, routing=routing))(params, x[:rows]))
    assert ("moe_decode_gate_up" in jaxpr) == decode
    w, ex = moe.route(params, x[:rows], routing)
    assert_close_rel(layer(params, x[:rows], routing=routing),
                     moe.reference(params, x[:rows], w, ex), 1e-5)


def test_bad_arguments_are_refused():
  routing = ROUTINGS[0]
  params, x = _layer("float", routing)
  w, ex = moe.route(params, x, routing)
  with pytest.raises(ValueError, match="both weights and experts"):
    moe_decode.moe_decode(params, x, routing, w, None)
  with pytest.raises(ValueError, match="top_k"):
    moe_decode.moe_decode(params, x, routing, w[:, :2], ex[:, :2])
  with pytest.raises(ValueError, match="activations are"):
    moe_decode.moe_decode(params, x.astype(BF16), routing)


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
def test_lowers_to_one_triton_kernel_per_stage(fmt):
  """bfloat16 at Qwen3-30B-A3B's expert shape, routed in the kernel: the router, the gate/up and
  the down pair kernel (and with the residual, the combine + norm) lower to Triton for an H200
  (each module verifies), with no XLA top-k, sort or clamp left between them."""
  sds = jax.ShapeDtypeStruct
  h, e, i = 2048, 128, 768
  key = jax.random.key(0)
  params = jax.eval_shape(lambda: moe.init_params(key, h, e, i, BF16, bias=True, experts=fmt))
  routing = moe.Routing(8, norm_topk_prob=True, scoring="sigmoid", scaling=2.5)
  plain = lambda p, x: moe_decode.moe_decode(p, x, routing, interpret=False)
  fused = lambda p, x: moe_decode.moe_decode(p, x, routing, residual=x, norm=x[0], shared=x,
                                             span=48, gate_up_block=64, interpret=False)
  for fn, want in ((plain, 3), (fused, 4)):
    with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
      lowered = jax.jit(fn).trace(params, sds((2, h), BF16)).lower(lowering_platforms=("cuda",))
    calls = triton_custom_calls(lowered)
    assert len(calls) == want
    names = []
    for call in calls:
      asm = verify_triton_ir(call)
      if asm is None:
        pytest.skip("the Triton module could not be parsed back")
      names.append(asm.split("@", 1)[1].split(" ", 1)[0])
      assert ("tt.dot" in asm) == (names[-1] not in ("moe_router", "moe_combine_norm"))
    assert "moe_router" in names and ("moe_combine_norm" in names) == (want == 4)
    text = lowered.as_text()
    assert "top_k" not in text and "sort" not in text and "minimum" not in text
