"""The project's scripts: user-facing ones here (generate, bench_matrix, coding_eval, draw_tree,
the training pipeline), performance tooling in `experiments.perf`. Run them as modules from the
repository root, e.g. `python -m experiments.generate --config=configs/default.py`."""

from absl import flags as _flags
from absl import logging as _logging

# Quiet by default: absl's INFO lines (JAX's backend probing, each compile) only with
# --verbosity=0 (parsed after this, it sets the level again); warnings and errors always.
_flags.FLAGS.set_default("verbosity", -1)
_logging.set_verbosity(_logging.WARNING)
