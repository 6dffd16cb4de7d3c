"""The project's scripts: user-facing ones here (generate, bench_matrix, coding_eval, draw_tree,
the training pipeline), performance tooling in `experiments.perf`. Run them as modules from the
repository root, e.g. `python -m experiments.generate --config=configs/default.py`."""
