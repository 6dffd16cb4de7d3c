"""Temperature > 0: chain and DDTree sampling follow the target's own distribution (Monte Carlo)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import ddtree_jax as dj
from ddtree_jax import engine, model, verify
from ddtree_jax.checkpoint import Target
from ddtree_jax.config import ModelConfig
from helpers import write_drafter

V = 4
PROMPT = [1, 3, 2]
N = 16000  # samples (batch entries) per run: expected TV of pure noise ~0.01


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  cfg = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
  target = Target(params=model.init_params(cfg, jax.random.key(3), jnp.float32, std=0.4), config=cfg)
  path = write_drafter(str(tmp_path_factory.mktemp("d")), cfg, num_layers=1, block_size=4,
                       mask_token_id=3, target_layer_ids=(0, 1), std=0.5)
  return target, dj.load_drafter(path, target)


def exact_joint(target, temperature, top_k=None, top_p=None):
  """p(x1, x2) [V, V] of the target's own filtered sampling."""
  filt = lambda l: jax.nn.softmax(verify.filter_logits(l, temperature, top_k, top_p), axis=-1)
  p1 = np.asarray(filt(dj.forward_logits(target, [PROMPT])[0, -1]), np.float64)
  ext = [PROMPT + [x] for x in range(V)]
  p2 = np.asarray(filt(dj.forward_logits(target, ext)[:, -1]), np.float64)
  return p1[:, None] * p2


def empirical_joint(target, drafter, method, budget, temperature, seed=0, **kw):
  res = dj.generate(target, [PROMPT] * N, method=method, drafter=drafter, budget=budget,
                    max_new_tokens=2, temperature=temperature, seed=seed, stop_token_ids=(), **kw)
  toks = np.asarray(res.tokens)
  counts = np.zeros((V, V))
  np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
  return counts


def check(counts, p):
  n = counts.sum()
  live = p.ravel() > 0
  assert counts.ravel()[~live].sum() == 0, "sampled a token the filters removed"
  tv = 0.5 * np.abs(counts.ravel() / n - p.ravel()).sum()
  # Chi-squared needs expected counts >= 5: pool the rare cells into one.
  expected = p.ravel() / p.ravel().sum() * n
  common = expected >= 5
  rare = live & ~common
  obs, exp = counts.ravel()[common], expected[common]
  if rare.any():
    obs, exp = np.append(obs, counts.ravel()[rare].sum()), np.append(exp, expected[rare].sum())
  assert len(obs) >= 2, "degenerate distribution: pick filters that keep several outcomes"
  return tv, sps.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("method,budget", [("chain", None), ("ddtree", 4), ("ddtree", 16),
                                           ("ddtree", 64)])
def test_sampling_matches_target_distribution(pair, method, budget, temperature):
  target, drafter = pair
  tv, pvalue = check(empirical_joint(target, drafter, method, budget, temperature),
                     exact_joint(target, temperature))
  assert tv < 0.02 and pvalue > 1e-3, (tv, pvalue)


@pytest.mark.parametrize("kw", [dict(top_k=2), dict(top_p=0.9), dict(top_k=3, top_p=0.95)])
def test_filtered_sampling_matches(pair, kw):
  target, drafter = pair
  tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0, **kw),
                     exact_joint(target, 1.0, **kw))
  assert tv < 0.02 and pvalue > 1e-3, (tv, pvalue)


def test_biased_acceptance_rule_is_caught(pair, monkeypatch):
  """Proof the test can fail: accept the drafter's top child at the root 30% of the time even
  when the target's sample disagrees (the kind of shortcut a min(1, p/q) port introduces)."""
  target, drafter = pair
  real_accept = verify.accept

  def biased(tokens, parents, depths, visibility, post, max_depth):
    u = jax.random.uniform(jax.random.key(7), post.shape[:1])
    root_post = jnp.where(u < 0.3, tokens[:, 1], post[:, 0])
    return real_accept(tokens, parents, depths, visibility, post.at[:, 0].set(root_post), max_depth)

  engine._PROGRAMS.clear()
  jax.clear_caches()
  monkeypatch.setattr(verify, "accept", biased)
  try:
    tv, pvalue = check(empirical_joint(target, drafter, "ddtree", 16, 1.0),
                       exact_joint(target, 1.0))
  finally:
    engine._PROGRAMS.clear()
    jax.clear_caches()
  assert tv > 0.02 or pvalue < 1e-3


def test_same_seed_same_output_and_greedy_limits(pair):
  target, drafter = pair
  prompts = [PROMPT, [3], [2, 2, 2, 0]]
  run = functools.partial(dj.generate, target, prompts, method="ddtree", drafter=drafter,
                          budget=8, max_new_tokens=12, stop_token_ids=())
  a, b = run(temperature=1.0, seed=5), run(temperature=1.0, seed=5)
  assert a.tokens == b.tokens
  assert run(temperature=1.0, seed=6).tokens != a.tokens
  greedy = dj.generate(target, prompts, max_new_tokens=12, stop_token_ids=()).tokens
  assert run(temperature=0.0).tokens == greedy
  assert run(temperature=1.0, top_k=1).tokens == greedy  # the sampling path with one choice
