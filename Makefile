# `make test` and `make demo` set everything up on a fresh machine.
# A working python3.12 on PATH (pyenv shims can exist without working), else the 3.12 under pyenv root.
PY312 := $(shell if python3.12 --version >/dev/null 2>&1; then command -v python3.12; \
	else ls -d "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1; fi)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train-drafter venv test test-fast demo serve clean train train-smoke eval-default bench bench-smoke eval-coding notebook

$(VENV)/.created:
	@test -x "$(PY312)" || (echo "need Python 3.12 (python3.12 on PATH or under pyenv root)"; exit 1)
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

# The library and one set of extras (pyproject.toml): core, serve, train, plots or test (all).
$(VENV)/.installed-%: pyproject.toml $(VENV)/.created
	$(PY) -m pip install -q -e ".$(if $(filter core,$*),,[$*])"
	touch $@

venv: $(VENV)/.installed-test

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The inner loop (a few minutes): the tree, the model and drafter, the decode loop's losslessness,
# requests, the registry, edge cases, the benchmark drafter and floors. `make test` runs all.
FAST := tree model drafter decode request registry edges benchmark_drafter floors
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 $(FAST:%=tests/test_%.py)

demo: $(VENV)/.installed-core
	$(PY) -m experiments.generate --config=configs/default.py

# OpenAI-compatible server on 127.0.0.1:8000 (the bundled pair; see configs/serve.py), e.g.
#   make serve ARGS="--config.serve.port=8001 --config.serve.budget=32"
serve: $(VENV)/.installed-serve
	$(PY) -m experiments.serve --config=configs/serve.py $(ARGS)

# The bundled default pair (ddtree_jax/default_model): GPU settings, ~17 min on one H200.
train: $(VENV)/.installed-train
	PY=$(PY) bash experiments/train_default.sh

# A DFlash drafter for any target this engine loads, on your prompts (JSONL or text):
#   make train-drafter TARGET=/models/Qwen3-8B DATA=prompts.jsonl [WORKDIR=out/train_drafter]
train-drafter: $(VENV)/.installed-train
	@test -n "$(TARGET)" -a -n "$(DATA)" || (echo "usage: make train-drafter TARGET=checkpoint-folder DATA=corpus [WORKDIR=...]"; exit 2)
	$(PY) -m experiments.train_drafter --config=configs/train_drafter.py:any \
	  --config.target=$(TARGET) --config.data=$(DATA) --config.workdir=$(or $(WORKDIR),out/train_drafter)

# The same pipeline with tiny settings on CPU (~1-2 min); writes only under /tmp/ddtree_smoke.
train-smoke: $(VENV)/.installed-train
	PY=$(PY) PRESET=:smoke WORKDIR=/tmp/ddtree_smoke INSTALL=/tmp/ddtree_smoke/default_model \
	  bash experiments/train_default.sh

eval-default: venv
	$(PY) -m experiments.eval_default

# GPU benchmark matrix: ar/chain/ddtree x budgets x batch, Qwen3-8B shape, bf16. Checkpoints from
# QWEN3_8B_DIR / QWEN3_8B_DFLASH_DIR, else random weights of the same shapes. Needs the CUDA
# extra in the venv: .venv/bin/pip install -e ".[cuda13]". Example:
#   make bench ARGS="--config.batches=1 --config.budgets=32,128 --mesh_tp=8"
bench: $(VENV)/.installed-plots
	$(PY) -m experiments.bench_matrix --config=configs/bench_matrix.py $(ARGS)

# Small matrix on CPU (~1 min): out/bench_smoke/{bench.csv,bench.json,*.png}
bench-smoke: $(VENV)/.installed-plots
	$(PY) -m experiments.bench_matrix --config=configs/bench_smoke.py $(ARGS)

# Five-problem coding check; generated code runs in the sandbox (ddtree_jax/tools/sandbox.py)
eval-coding: venv
	$(PY) -m experiments.coding_eval --config=configs/default.py $(ARGS)

# Executes the walkthrough notebook; the executed copy goes to out/ddtree_walkthrough.ipynb
notebook: venv
	mkdir -p out
	$(VENV)/bin/jupyter-execute notebooks/ddtree_walkthrough.ipynb --output=../out/ddtree_walkthrough

clean:
	rm -rf $(VENV)
