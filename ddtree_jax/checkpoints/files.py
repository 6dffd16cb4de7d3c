"""Files a user keeps are written atomically: a temporary file in the same directory, flushed and
fsynced, then renamed over the target (the directory fsynced too). A killed export or benchmark
leaves the old file or the new one, never a torn one. Also: stale orbax temporaries."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import tempfile

import numpy as np


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", **open_kwargs):
  """A file object for `path` that replaces it only once fully written."""
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
  try:
    with os.fdopen(fd, mode, **open_kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise
  dir_fd = os.open(folder, os.O_RDONLY)
  try:
    os.fsync(dir_fd)
  finally:
    os.close(dir_fd)


def write_json(path: str, obj, **kwargs) -> None:
  """json.dump(obj, **kwargs) to path, atomically."""
  with atomic_write(path, "w") as f:
    json.dump(obj, f, **kwargs)


def write_text(path: str, text: str) -> None:
  with atomic_write(path, "w") as f:
    f.write(text)


def save_npy(path: str, array) -> None:
  """np.save to path, atomically."""
  with atomic_write(path) as f:
    np.save(f, np.asarray(array), allow_pickle=False)


def save_figure(fig, path: str, **kwargs) -> None:
  """fig.savefig(path, **kwargs), atomically (the format from the file name)."""
  fmt = os.path.splitext(path)[1].lstrip(".") or "png"
  with atomic_write(path) as f:
    fig.savefig(f, format=fmt, **kwargs)


def save_tokenizer(tokenizer, path: str) -> None:
  """A `tokenizers.Tokenizer` as tokenizer.json at path, atomically."""
  write_text(path, tokenizer.to_str())


def remove_stale_temporaries(directory: str) -> list[str]:
  """Deletes the `.NAME.*.tmp` files that a killed `atomic_write` leaves in `directory`."""
  stale = sorted(glob.glob(os.path.join(glob.escape(directory), ".*.tmp")))
  for p in stale:
    os.unlink(p)
  return stale


def remove_stale_orbax_temporaries(directory: str, name: str = "*") -> list[str]:
  """Deletes the `NAME.orbax-checkpoint-tmp*` entries that a killed orbax save leaves in
  `directory` (name: a glob, every checkpoint by default); returns what it removed (each is
  also logged)."""
  pattern = os.path.join(glob.escape(directory), f"{name}.orbax-checkpoint-tmp*")
  stale = sorted(glob.glob(pattern))
  for p in stale:
    logging.getLogger(__name__).warning("removing %s: a save that did not finish", p)
    if os.path.isdir(p):
      shutil.rmtree(p, ignore_errors=True)
    else:
      os.unlink(p)
  return stale
