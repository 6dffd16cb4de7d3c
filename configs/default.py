"""Default run: the small model pair bundled with the repo (`make demo`), for every script.

The pair lives in ddtree_jax/default_model/{target,drafter} (`dj.DEFAULT_MODEL_DIR`, made by
`make train`); while it is absent the tiny test fixture tests/fixtures/hf/qwen3_gqa is used, AR only.
Every other config file starts from this one, and scripts refuse keys this file does not define.

Override from the command line, e.g. --config.max_new_tokens=64 --config.target=/path/to/Qwen3-8B,
or with env vars DDTREE_TARGET / DDTREE_DRAFTER. The generate options' defaults are
`request.GenerateOptions`' (None spelled "" or 0 here).
"""

import os

import ml_collections

import ddtree_jax as dj
from ddtree_jax.request import GenerateOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_TARGET = os.path.join(REPO, "tests/fixtures/hf/qwen3_gqa")


def default_pair():
  """(target dir, drafter dir) of the bundled pair, or (fixture target, "") while it is absent."""
  d = dj.DEFAULT_MODEL_DIR
  target, drafter = os.path.join(d, "target"), os.path.join(d, "drafter")
  if all(os.path.exists(os.path.join(p, "config.json")) for p in (target, drafter)):
    return target, drafter
  return FIXTURE_TARGET, ""


def qwen3_8b_shape():
  """Qwen3-8B architecture (used when random_target=True)."""
  s = ml_collections.ConfigDict()
  s.model_type = "qwen3"
  s.vocab_size = 151936
  s.hidden_size = 4096
  s.intermediate_size = 12288
  s.num_layers = 36
  s.num_heads = 32
  s.num_kv_heads = 8
  s.head_dim = 128
  s.rope_theta = 1000000.0
  s.rms_norm_eps = 1e-6
  s.tie_word_embeddings = False
  return s


def get_config():
  c = ml_collections.ConfigDict()
  target, drafter = default_pair()
  c.target = os.environ.get("DDTREE_TARGET", target)
  c.drafter = os.environ.get("DDTREE_DRAFTER", drafter if "DDTREE_TARGET" not in os.environ else "")
  c.dtype = "float32"                                # float32 | bfloat16 | float16
  c.drafter_int8 = False                             # int8 W8A8 drafter (drafter.quantize_int8)
  c.draft_vocab = ""                                 # .npy of the ids to draft over ("" = all;
                                                     # drafter.restrict_vocab, frequent_tokens)
  c.methods = "ar,chain,ddtree" if c.drafter else "ar"  # comma list of ar, chain, ddtree
  c.budgets = "8,32"                                 # ddtree budgets, each in [1, 1024], or
                                                     # auto: each step chooses one of:
  c.auto_budgets = "0,8,16,32,64"                    # budget=auto's options (0 = AR)
  c.budget_costs = ""                                # their seconds per step ("" = measured)
  c.auto_every = 1                                   # budget=auto chooses every this many steps
  c.prompts = ("def is_palindrome(s):", "def fib(n):", "import os\n")
  c.max_new_tokens = 96
  c.temperature = GenerateOptions.temperature
  c.attention = GenerateOptions.attention or ""      # "" = request.default_attention(): pallas
                                                     # on GPU, xla elsewhere
  c.seed = GenerateOptions.seed
  c.topk_cap = GenerateOptions.topk_cap or 0         # ddtree tokens kept per depth (0 = budget)
  c.ignore_eos = False                               # True: never stop early (benchmarks)
  c.steps_per_check = GenerateOptions.steps_per_check  # decode steps per host check of the stop
                                                     # condition (> 1: idle steps at the end)
  c.out_dir = "out/default"                          # CSV / JSON / PNG outputs of the scripts

  # An OpenAI-compatible server instead of the in-process engine (bench_matrix, coding_eval):
  # e.g. http://127.0.0.1:8000 (experiments/serve.py, SGLang, vLLM); "" = in-process.
  c.endpoint = ""
  c.endpoint_model = ""                              # "" = the server's first model
  c.concurrency = "1,4,16,32"                        # bench_matrix over HTTP: concurrent requests
  c.requests_per_level = 32                          # requests per concurrency level

  # Benchmark matrix (experiments/bench_matrix.py): methods x budgets x batches.
  c.batches = "1"                                    # concurrency: prompts per generate call
  c.repeats = 3                                      # timed runs per cell (median), after warm-up
  c.baselines = True                                 # always run ar (and chain with a drafter)
  c.prompt_len = 0                                   # > 0: random prompts of this many tokens
  c.profile = "all"                                  # per-stage times: "", "all" or methods list
  c.profile_repeats = 5
  c.compile_threads = 1                              # programs of a batch compiled in parallel
  c.near_tie_eps = 0.1                               # top-1 minus top-2 logit gap of a near-tie
  c.progress = True                                  # tqdm progress bars

  # Random weights instead of checkpoints (step timing without downloads; acceptance ~1).
  c.random_target = False                            # build the target from `shape`
  c.shape = qwen3_8b_shape()
  c.random_drafter = False                           # a random DFlash drafter for the target
  c.drafter_shape = ml_collections.ConfigDict()
  c.drafter_shape.num_layers = 5
  c.drafter_shape.block_size = 16
  c.drafter_shape.target_layer_ids = ""              # "" = the DFlash default rule
  c.drafter_shape.mask_token_id = -1                 # -1 = vocab_size - 1
  c.drafter_shape.init_std = 0.02                    # larger: peakier drafts, deeper trees

  # Coding check (experiments/coding_eval.py): generated code runs in a sandboxed subprocess.
  c.coding = ml_collections.ConfigDict()
  c.coding.problems = "is_palindrome,fib,merge_sorted,word_count,gcd"
  c.coding.max_new_tokens = 128
  c.coding.timeout_s = 5.0                           # wall clock (and CPU) per problem
  c.coding.memory_mb = 512                           # RLIMIT_AS of the sandboxed process
  return c
