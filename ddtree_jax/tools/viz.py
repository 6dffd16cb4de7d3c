"""Pictures of DDTree draft trees (matplotlib).

  tree = dj.build_tree(draft_logits, budget=32, root_token=bonus)
  ax = viz.draw_tree(tree, accepted_path=path, tokenizer=target.tokenizer)
  ax.figure.savefig("tree.png")

Layered layout: depth d at x = d (root at the left), leaves stacked top to bottom in depth-first
order (children by descending score), every parent centred on its children. Node colour = the
prefix probability exp(score); the accepted path (root first) is drawn in red with thick edges.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def tree_arrays(tree):
  """(tokens, parents, depths, scores) of an unbatched DraftTree, or of batch row 0 if batched
  with batch size 1."""
  arrays = [np.asarray(getattr(tree, f)) for f in ("tokens", "parents", "depths", "scores")]
  if arrays[0].ndim == 2:
    if arrays[0].shape[0] != 1:
      raise ValueError(f"draw_tree takes one tree; got a batch of {arrays[0].shape[0]} (index it "
                       "first, e.g. jax.tree.map(lambda x: x[i], tree))")
    arrays = [a[0] for a in arrays]
  if arrays[0].ndim != 1:
    raise ValueError(f"tree.tokens must be [N] (or [1, N]), got shape {arrays[0].shape}")
  return arrays


def layout(parents, scores) -> np.ndarray:
  """[N, 2] node coordinates (x = depth, y = row), parents centred on their children."""
  n = len(parents)
  children = [[] for _ in range(n)]
  for i in range(1, n):
    children[int(parents[i])].append(i)
  pos = np.zeros((n, 2))
  next_row = [0.0]

  def place(i, depth):  # recursion depth <= tree depth (the drafter's block size)
    pos[i, 0] = depth
    kids = sorted(children[i], key=lambda c: -scores[c])
    if not kids:
      pos[i, 1] = next_row[0]
      next_row[0] += 1
      return
    for c in kids:
      place(c, depth + 1)
    pos[i, 1] = np.mean([pos[c, 1] for c in kids])

  place(0, 0)
  pos[:, 1] = -pos[:, 1]  # first leaf at the top
  return pos


def token_label(token: int, tokenizer=None, max_chars: int = 10) -> str:
  if token < 0:
    return "root"
  if tokenizer is None:
    return str(int(token))
  text = tokenizer.decode([int(token)])
  text = repr(text)[1:-1] if text else f"<{int(token)}>"
  return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def draw_tree(tree, accepted_path: Sequence[int] | None = None, tokenizer=None, ax=None,
              max_label_chars: int = 10, title: str | None = None):
  """Draws one DraftTree (from dj.build_tree or decode.make_tree; unbatched or batch 1).

  accepted_path: node indices of the accepted path (root first), e.g. `path[:tau]` of
  verify.accept; they are highlighted. tokenizer: labels are decoded tokens (else token ids).
  Returns the matplotlib Axes."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  tokens, parents, depths, scores = tree_arrays(tree)
  n = len(tokens)
  pos = layout(parents, scores)
  rows = max(1, int(-pos[:, 1].min()) + 1)
  if ax is None:
    _, ax = plt.subplots(figsize=(2.0 + 1.3 * (int(depths.max()) + 1), min(2.0 + 0.28 * rows, 60)))
  on_path = np.zeros(n, bool)
  if accepted_path is not None:
    path = [int(i) for i in np.asarray(accepted_path).reshape(-1)]
    bad = [i for i in path if not 0 <= i < n]
    if bad:
      raise ValueError(f"accepted_path has node ids {bad} outside [0, {n})")
    on_path[path] = True
  prob = np.exp(np.clip(scores.astype(np.float64), -50, 0))
  cmap = matplotlib.colormaps["Blues"]
  fontsize = 8 if rows <= 40 else max(3, int(8 * 40 / rows))
  for i in range(1, n):
    p = int(parents[i])
    hot = on_path[i] and on_path[p]
    ax.plot([pos[p, 0], pos[i, 0]], [pos[p, 1], pos[i, 1]], color="crimson" if hot else "0.7",
            linewidth=2.5 if hot else 0.8, zorder=1)
  for i in range(n):
    face = "gold" if i == 0 else cmap(0.15 + 0.75 * prob[i])
    ax.text(pos[i, 0], pos[i, 1], token_label(int(tokens[i]), tokenizer, max_label_chars),
            ha="center", va="center", fontsize=fontsize, zorder=3,
            color="white" if (i and prob[i] > 0.6) else "black",
            bbox=dict(boxstyle="round,pad=0.25", facecolor=face,
                      edgecolor="crimson" if on_path[i] else "0.4",
                      linewidth=2.0 if on_path[i] else 0.6))
  ax.set_xlim(-0.6, pos[:, 0].max() + 0.6)
  ax.set_ylim(pos[:, 1].min() - 0.8, 0.8)
  ax.set_xticks(range(int(depths.max()) + 1))
  ax.set_xlabel("depth (position after the committed prefix)")
  ax.set_yticks([])
  for side in ("top", "right", "left"):
    ax.spines[side].set_visible(False)
  if title is None:
    title = f"draft tree: {n - 1} nodes, depth {int(depths.max())}"
    if accepted_path is not None:
      title += f", accepted {int(on_path.sum())} (root included)"
  ax.set_title(title, fontsize=10)
  return ax
