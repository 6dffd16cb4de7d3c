#!/usr/bin/env bash
# The bundled default pair, end to end (`make train`): tokenizer -> target -> regenerate ->
# drafter -> install. Environment: PY (python, default python3), PRESET ("" = GPU settings,
# ":smoke" = tiny CPU run), WORKDIR (default out/train_default), INSTALL (default
# ddtree_jax/default_model), TARGET_ARGS / DRAFTER_ARGS (more config overrides, e.g. the shape a
# sweep picked). Every step resumes or skips what its workdir already holds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PRESET=${PRESET:-}
WORKDIR=${WORKDIR:-out/train_default}
INSTALL=${INSTALL:-ddtree_jax/default_model}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "=== $1 ($(( $(date +%s) - t0 )) s)"; }
stamp tokenizer
"$PY" -m experiments.train_tokenizer --config="configs/train_target.py$PRESET" --config.workdir="$WORKDIR"
stamp target
"$PY" -m experiments.train_target --config="configs/train_target.py$PRESET" --config.workdir="$WORKDIR" ${TARGET_ARGS:-}
stamp regenerate
"$PY" -m experiments.train_drafter --config="configs/train_drafter.py$PRESET" --config.workdir="$WORKDIR" --config.stage=regenerate ${DRAFTER_ARGS:-}
stamp drafter
"$PY" -m experiments.train_drafter --config="configs/train_drafter.py$PRESET" --config.workdir="$WORKDIR" --config.stage=train ${DRAFTER_ARGS:-}
stamp install
"$PY" -m experiments.install_default --workdir="$WORKDIR" --out="$INSTALL"
stamp done
