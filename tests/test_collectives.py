"""The collectives of the compiled AR step and DDTree verify step on tp meshes of 8 forced CPU
devices, per layer and outside the layers (experiments/perf/collectives.py reads them after
XLA's SPMD partitioner), and the one-all-reduce layout's tokens equal one device's."""

import collections

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ddtree_jax as dj
from ddtree_jax import sharding
from ddtree_jax.models.config import ModelConfig
from experiments.perf import collectives, harness
from helpers import oracle_drafter, write_drafter, write_target

H = 64
SMALL = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=H, intermediate_size=128,
                    num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16, rope_theta=1e6,
                    max_position_embeddings=4096)
BUDGET = 8


def _table(counter):
  """{(kind, types, group size): count}."""
  out = collections.Counter()
  for c, n in counter.items():
    out[(c.kind, c.types, c.group)] += n
  return dict(out)


def _breakdown(tp, method, layout):
  return collectives.breakdown(collectives.Program(
      shape=SMALL, mesh={"dp": 1, "tp": tp}, method=method, budget=BUDGET, prefix=64,
      rules=sharding.LAYOUTS[layout]))


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("method", ["ar", "verify"])
def test_split_layout_collectives(tp, method):
  """Megatron's split: per layer the o and down projections' bf16 all-reduces of the [B, T, H]
  residual, nothing else; outside the layers the embedding lookup's psum and the argmax's two
  small gathers of (value, index) per shard. T = 1 (AR) or BUDGET + 1 (the tree). A one-row
  step's projections run on the row given twice (`ops.einsum_weight`), so its layers'
  all-reduces carry [2, 1, H]."""
  t = 1 if method == "ar" else BUDGET + 1
  b = _breakdown(tp, method, "split")
  rows, layer_rows = f"bf16[1,{t},{H}]", f"bf16[{2 if t == 1 else 1},{t},{H}]"
  assert _table(b["layer"]) == {("all-reduce", layer_rows, tp): 2}
  assert _table(b["rest"]) == {("all-reduce", rows, tp): 1,
                               ("all-gather", f"f32[1,{t},{tp}]", tp): 1,
                               ("all-gather", f"s32[1,{t},{tp}]", tp): 1}
  assert collectives.nbytes(b["layer"]) == 2 * (2 if t == 1 else t) * H * 2
  assert {c.stage for c in b["layer"]} == {"verify" if method == "ar" else "forward"}


@pytest.mark.parametrize("method", ["ar", "verify"])
def test_replicated_attention_layout_has_one_all_reduce_per_layer(method):
  t = 1 if method == "ar" else BUDGET + 1
  b = _breakdown(8, method, "replicated_attention")
  assert _table(b["layer"]) == {("all-reduce", f"bf16[{2 if t == 1 else 1},{t},{H}]", 8): 1}
  assert sum(b["rest"].values()) == 3


def test_drafter_fc_is_split_only_with_its_kv_heads():
  """A split fc output with replicated kv heads made GSPMD split the drafter's residual stream
  over H (12 collectives per drafter layer at the Qwen3-30B-A3B shape on tp=8): fc follows."""
  dparams = jax.eval_shape(lambda: harness.random_drafter(SMALL, jax.random.key(1))[0])
  mesh = sharding.make_mesh({"dp": 1, "tp": 8})
  assert sharding.specs(dparams, mesh).fc == P(None, "tp")
  for rules in (sharding.ShardingRules(kv_heads=None), sharding.LAYOUTS["replicated_attention"]):
    assert sharding.specs(dparams, mesh, rules).fc == P(None, None)


def test_replicated_attention_layout_tokens_equal_one_device(tmp_path):
  """AR and DDTree (an oracle drafter) on tp=8 with attention replicated: the unsharded tokens
  and acceptance lengths (float32); attention weights and caches whole on every device, the
  MLP and vocab split, the drafter's fc whole."""
  prompts = [[3, 17, 99, 4, 250, 31, 8], [42], [200, 1, 0]]
  path = write_target(str(tmp_path / "target"))
  one = dj.load_target(path, dtype="float32", fuse_qkv=False)
  dpath = write_drafter(str(tmp_path / "drafter"), one.config, block_size=8)
  ar = dj.generate(one, prompts, max_new_tokens=16, stop_token_ids=()).tokens
  ref = dj.generate(one, prompts, method="ddtree", budget=16, max_new_tokens=16,
                    stop_token_ids=(), drafter=oracle_drafter(dj.load_drafter(dpath, one),
                                                              prompts, ar))
  assert ref.tokens == ar
  mesh = sharding.make_mesh({"dp": 1, "tp": 8})
  rules = sharding.LAYOUTS["replicated_attention"]
  target = dj.load_target(path, dtype="float32", mesh=mesh, rules=rules)
  drafter = dj.load_drafter(dpath, target)
  laid = lambda x, *spec: x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)
  layer = target.params.layers[0]
  assert laid(layer.wq, None, None, None) and laid(layer.wo, None, None, None)
  assert laid(layer.w_down, "tp", None) and laid(target.params.lm_head, None, "tp")
  assert laid(drafter.params.fc, None, None)
  assert dj.generate(target, prompts, max_new_tokens=16, stop_token_ids=()).tokens == ar
  res = dj.generate(target, prompts, method="ddtree", budget=16, max_new_tokens=16,
                    stop_token_ids=(), drafter=oracle_drafter(drafter, prompts, ar))
  assert res.tokens == ar
  assert res.stats["acceptance_lengths"] == ref.stats["acceptance_lengths"]
