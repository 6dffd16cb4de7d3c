# Retrains the bundled drafter (same target) with the any-target pipeline, on CPU.
# Prompts: python make_prompts.py $CORPUS 4160 (from the repository root, with its venv).
cd "$(dirname "$0")/../../.."  # the repository root
.venv/bin/python -m experiments.train_drafter --config=configs/train_drafter.py:any \
  --config.target=ddtree_jax/default_model/target --config.data=${CORPUS:-/tmp/d64/corpus.jsonl} \
  --config.workdir=${WORKDIR:-/tmp/d64/w} --config.drafter.num_layers=2 --config.drafter.target_layer_ids=1,3 \
  --config.drafter.block_size=16 --config.regen.num_sequences=4096 --config.regen.heldout_sequences=64 \
  --config.regen.prompt_max=96 --config.regen.new_tokens=160 --config.regen.batch_size=512 \
  --config.regen.time_budget_s=150 --config.regen.dtype=float32 --config.regen.matmul_precision=highest \
  --config.train.batch_size=8 --config.train.num_anchors=48 --config.train.time_budget_s=480 \
  --config.train.num_steps=20000 --config.train.lr=2e-3 --config.train.compute_dtype=float32 \
  --config.train.target_dtype=float32 --config.train.progress_bar=False --config.eval.budgets=16,32 \
  --config.eval.new_tokens=128
