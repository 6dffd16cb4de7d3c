"""The PyTorch reference (HF transformers, SDPA, bf16) at the Qwen3-30B-A3B shape, random weights:
the per-round cost of DDTree as the reference implementation pays it, for the ratio against
`bench_moe`. Runs with the GPU machine's python3 (torch + transformers), not the project's venv.

  python3 -m experiments.perf.ref_hf_moe            # one GPU
  python3 -m experiments.perf.ref_hf_moe --small    # tiny shapes on CPU (smoke)

Times, over a --prefix cache (DynamicCache, cropped back after every call): the target forward of
T new tokens with logits for every row (T = 1: an AR token; T = B + 1: the verify of a budget-B
tree, timed with a causal mask over the new tokens: the reference passes a tree mask, which
costs SDPA no less) and the drafter's forward (5 dense Qwen3 layers of the target's width over
16 tokens, then the target's lm_head). round(B) = verify(B + 1) + draft; the reference's host
tree build and commit are not included, so its rounds here are a lower bound.
"""

import json
import statistics
import time

from absl import app, flags

from experiments.perf import common_flags

common_flags.define("small", "prefix", "repeats", "json_out")
flags.DEFINE_string("tokens", "1,5,17,33,65,129", "new tokens T per forward")
FLAGS = flags.FLAGS


def configs(small: bool):
  """(Qwen3MoeConfig of the target, Qwen3Config of the drafter's layers)."""
  from transformers import Qwen3Config, Qwen3MoeConfig  # pylint: disable=import-outside-toplevel
  if small:
    shape = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    moe = dict(intermediate_size=128, num_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=32)
  else:
    shape = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    moe = dict(intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768)
  common = dict(max_position_embeddings=40960, rope_theta=1e7, tie_word_embeddings=False,
                attn_implementation="sdpa")
  target = Qwen3MoeConfig(**shape, **moe, norm_topk_prob=True, **common)
  drafter = Qwen3Config(**{**shape, "num_hidden_layers": 2 if small else 5},
                        intermediate_size=moe["intermediate_size"], **common)
  return target, drafter


def timed(fn, sync, repeats):
  fn()
  times = []
  for _ in range(repeats):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def reset(cache, length: int):
  """Crops a DynamicCache back to `length` tokens (a negative crop: every version takes it)."""
  extra = cache.get_seq_length() - length
  if extra > 0:
    cache.crop(-extra)


def emit(row):
  print(json.dumps(row), flush=True)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "a") as f:
      f.write(json.dumps(row) + "\n")


def main(_):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from transformers import DynamicCache, Qwen3MoeForCausalLM, Qwen3Model  # pylint: disable=import-outside-toplevel
  dev = "cpu" if FLAGS.small or not torch.cuda.is_available() else "cuda"
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  tcfg, dcfg = configs(FLAGS.small)
  torch.manual_seed(0)
  torch.set_default_dtype(torch.bfloat16)
  t0 = time.perf_counter()
  with torch.device(dev):
    target = Qwen3MoeForCausalLM(tcfg).eval()
    drafter = Qwen3Model(dcfg).eval()
  print(f"torch {torch.__version__} transformers {transformers.__version__} on {dev}: built in "
        f"{time.perf_counter() - t0:.1f} s; experts implementation "
        f"{getattr(tcfg, '_experts_implementation', None)!r}, attention "
        f"{tcfg._attn_implementation!r}", flush=True)  # pylint: disable=protected-access
  p = FLAGS.prefix
  gen = torch.Generator(device="cpu").manual_seed(1)
  ids = lambda n: torch.randint(0, tcfg.vocab_size, (1, n), generator=gen).to(dev)
  with torch.inference_mode():
    cache = DynamicCache(config=tcfg)
    target(ids(p), past_key_values=cache, use_cache=True, logits_to_keep=1)
    dcache = DynamicCache(config=dcfg)
    drafter(ids(p), past_key_values=dcache, use_cache=True)

    def verify(t):
      new = ids(t)
      pos = torch.arange(p, p + t, device=dev)[None]

      def run():
        reset(cache, p)
        target(new, past_key_values=cache, position_ids=pos, use_cache=True)
      return run

    def draft():
      reset(dcache, p)
      out = drafter(ids(16), past_key_values=dcache, use_cache=True,
                    position_ids=torch.arange(p, p + 16, device=dev)[None])
      target.lm_head(out.last_hidden_state)

    draft_ms = timed(draft, sync, FLAGS.repeats) * 1e3
    emit({"section": "ref_draft", "ms": draft_ms, "prefix": p})
    for t in (int(x) for x in FLAGS.tokens.split(",") if x):
      ms = timed(verify(t), sync, FLAGS.repeats) * 1e3
      emit({"section": "ref_forward", "tokens": t, "ms": ms, "prefix": p,
            "round_ms": None if t == 1 else ms + draft_ms})


if __name__ == "__main__":
  app.run(main)
