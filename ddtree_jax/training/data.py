"""Training data for the bundled default model: the running interpreter's standard library plus
the installed sources of the project's own dependencies (DEPENDENCIES) or of every installed
package ("all": the package versions are recorded beside the token streams).

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]` (relative paths as they are), and
under each dependency's package directory (as `site-packages/<name>/...`), minus tests, GUI/demo
code, vendored packages and generated files (EXCLUDE_* below), read as UTF-8 (files that are not
are skipped). Split: a file is held out when the first 8 hex digits of sha256(relative posix
path), read as a fraction of 2**32, fall below `heldout_fraction` (default 2%). The split depends
on the path alone, so it is the same on every machine that has the file, and a stdlib file is
held out whatever dependencies are added.

Batches are pure functions of (seed, step): a resumed run sees exactly the data it would have.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import numpy as np

from ddtree_jax.checkpoints import files

EXCLUDE_DIRS = frozenset({
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
    "dist-packages", "ensurepip", "encodings", "pydoc_data", "__pycache__", "lib-dynload",
    "__phello__"})
EXCLUDE_PREFIXES = ("config-", "_sysconfigdata")   # build configuration, generated
EXCLUDE_SUFFIXES = ("_gen.py", "_pb2.py")           # generated bindings (MLIR ops, protobufs)
EXCLUDE_FILES = frozenset({"html/entities.py"})     # a 75 KB table of character names
# The project's runtime dependencies with Python sources (import names, pyproject's order).
DEPENDENCIES = ("jax", "jaxlib", "ml_dtypes", "orbax", "numpy", "absl", "ml_collections", "optax",
                "tokenizers", "tqdm", "matplotlib")

EOS = "<|endoftext|>"
MASK = "<|mask|>"


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def package_dir(name: str) -> str:
  """The installed directory of package `name` (a ValueError naming it when absent)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(f"corpus package {name!r} is not installed (or not a package)")
  return list(spec.submodule_search_locations)[0]


def sources(root: str | None = None, packages=()) -> list[tuple[str, str]]:
  """(path prefix, directory) of each part of the corpus: the stdlib (or `root`), then each of
  `packages` under "site-packages/<name>/"."""
  return [("", root or stdlib_root())] + [(f"site-packages/{p}/", package_dir(p))
                                          for p in packages]


def installed_packages() -> list[str]:
  """Import names of every installed distribution's top-level package with Python sources
  (sorted; private names, single-file modules and this project left out)."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import importlib.util  # pylint: disable=import-outside-toplevel
  out = []
  for name in sorted(importlib.metadata.packages_distributions()):
    if name.startswith("_") or not name.isidentifier() or name == __name__.split(".")[0]:
      continue
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    if spec is not None and spec.submodule_search_locations:
      out.append(name)
  return out


def resolve_packages(packages) -> list[str]:
  """A comma list (or sequence) of import names; "deps" stands for DEPENDENCIES, "all" for
  every installed package (`installed_packages`). Duplicates are dropped, first kept."""
  names = packages.split(",") if isinstance(packages, str) else list(packages)
  out = []
  for n in (n.strip() for n in names):
    group = (list(DEPENDENCIES) if n == "deps" else installed_packages() if n == "all"
             else [n] if n else [])
    out += [g for g in group if g not in out]
  return out


def list_files(root: str | None = None, prefix: str = "") -> list[str]:
  """Sorted relative posix paths (each with `prefix`) of the corpus files under `root` (default:
  the stdlib)."""
  root = root or stdlib_root()
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    dirnames[:] = [d for d in dirnames
                   if d not in EXCLUDE_DIRS and not d.startswith(EXCLUDE_PREFIXES)]
    for name in filenames:
      rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
      if (name.endswith(".py") and not name.startswith(EXCLUDE_PREFIXES)
          and not name.endswith(EXCLUDE_SUFFIXES) and rel not in EXCLUDE_FILES):
        out.append(prefix + rel)
  return sorted(out)


def split_of(rel_path: str, heldout_fraction: float = 0.02) -> str:
  """'heldout' or 'train', from a hash of the relative path alone."""
  h = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) / 2 ** 32
  return "heldout" if h < heldout_fraction else "train"


def read_split(split: str, root: str | None = None, heldout_fraction: float = 0.02,
               max_files: int = 0, packages=()) -> list[tuple[str, str]]:
  """[(relative path, text)] of one split, in path order per source (the stdlib, then each
  package; the first `max_files` of each when > 0)."""
  docs = []
  for prefix, directory in sources(root, packages):
    part = []
    for rel in list_files(directory, prefix):
      if split_of(rel, heldout_fraction) != split:
        continue
      try:
        with open(os.path.join(directory, rel[len(prefix):]), encoding="utf-8") as f:
          text = f.read()
      except (UnicodeDecodeError, OSError):
        continue
      if text.strip():
        part.append((rel, text))
      if max_files and len(part) >= max_files:
        break
    docs += part
  return docs


def train_tokenizer(texts, vocab_size: int):
  """Byte-level BPE (GPT-2 style pre-tokenizer, lossless round trip); ids 0/1 = EOS/MASK."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                min_frequency=2, show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def encode_documents(tokenizer, texts) -> np.ndarray:
  """One int32 stream: each document's tokens followed by EOS."""
  eos = tokenizer.token_to_id(EOS)
  parts = []
  for enc in tokenizer.encode_batch(list(texts)):
    parts.append(np.asarray(enc.ids, np.int32))
    parts.append(np.asarray([eos], np.int32))
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def _rng(*keys: int) -> np.random.Generator:
  return np.random.default_rng([int(k) for k in keys])


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int, length: int) -> tuple[int, np.ndarray]:
  g = _rng(seed, epoch)
  return int(g.integers(0, length)), g.permutation(n)


def window_batch(tokens: np.ndarray, batch: int, length: int, seed: int, step: int) -> np.ndarray:
  """Batch `step` of [batch, length] windows of the stream. Each epoch cuts the stream into
  non-overlapping windows at a random offset and visits them in a random order."""
  n = (len(tokens) - length) // length
  if n < 1:
    raise ValueError(f"token stream of {len(tokens)} is too short for windows of {length}")
  out = np.empty((batch, length), np.int32)
  for j in range(batch):
    i = step * batch + j
    epoch, r = divmod(i, n)
    offset, order = _epoch_order(seed, epoch, n, length)
    start = offset + int(order[r]) * length
    out[j] = tokens[start:start + length]
  return out


def eval_windows(tokens: np.ndarray, count: int, length: int) -> np.ndarray:
  """Up to `count` fixed, evenly spaced [length] windows (held-out loss)."""
  n = max((len(tokens) - 1) // length, 0)
  if n == 0:
    raise ValueError(f"token stream of {len(tokens)} is too short for windows of {length}")
  idx = np.linspace(0, n - 1, min(count, n)).astype(np.int64)
  return np.stack([tokens[i * length:(i + 1) * length] for i in idx])


def prompt_windows(tokens: np.ndarray, count: int, min_len: int, max_len: int,
                   seed: int) -> list[np.ndarray]:
  """`count` prompts cut at random places of the stream, lengths uniform in [min_len, max_len]."""
  g = _rng(seed, 7)
  lens = g.integers(min_len, max_len + 1, size=count)
  starts = g.integers(0, len(tokens) - max_len, size=count)
  return [tokens[s:s + l].copy() for s, l in zip(starts, lens)]


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, seed: int, epoch: int,
                   index: int) -> tuple[np.ndarray, np.ndarray]:
  """Anchors of one drafter-training sequence: positions a with prompt_len <= a <= seq_len - 2
  (x_a is a target-generated token, as the bonus is at inference, and x_{a+1} exists), a fresh
  sample without replacement per epoch. Returns (anchors [num_anchors] int32, valid [num_anchors])."""
  cand = np.arange(prompt_len, seq_len - 1, dtype=np.int32)
  g = _rng(seed, epoch, index, 13)
  pick = np.sort(g.permutation(cand)[:num_anchors]) if len(cand) else cand
  anchors = np.zeros((num_anchors,), np.int32)
  valid = np.zeros((num_anchors,), bool)
  anchors[:len(pick)] = pick
  valid[:len(pick)] = True
  return anchors, valid


def drafter_batch(tokens: np.ndarray, lens: np.ndarray, prompt_lens: np.ndarray, batch: int,
                  num_anchors: int, seed: int, step: int) -> dict[str, np.ndarray]:
  """Batch `step` of drafter training: sequences in a fresh random order per epoch, each with a
  fresh anchor sample per epoch. tokens [N, S] (prompt + target continuation, right-padded),
  lens [N], prompt_lens [N]; "rows" says which sequences it took (for their captured features)."""
  n = len(tokens)
  rows = np.empty((batch,), np.int64)
  anchors = np.zeros((batch, num_anchors), np.int32)
  ok = np.zeros((batch, num_anchors), bool)
  for j in range(batch):
    epoch, r = divmod(step * batch + j, n)
    _, order = _epoch_order(seed, epoch, n, 1)
    rows[j] = order[r]
    anchors[j], ok[j] = sample_anchors(int(prompt_lens[rows[j]]), int(lens[rows[j]]), num_anchors,
                                       seed, epoch, int(rows[j]))
  return {"tokens": tokens[rows], "lens": lens[rows].astype(np.int32), "anchors": anchors,
          "anchor_ok": ok, "rows": rows}


def prepare_corpus(workdir: str, vocab_size: int, heldout_fraction: float = 0.02,
                   max_files: int = 0, root: str = "", packages=()):
  """Tokenizer + token streams, cached under `workdir`: tokenizer.json, data/{train,heldout}.npy
  (uint16 when the vocabulary fits) and data/corpus.json (settings, package versions, file
  lists, sizes). Returns (tokenizer, train, heldout) as int32 streams; a cache made with other
  settings is refused rather than reused. A tokenizer.json already in `workdir` without token
  caches (one brought from another machine, whose target it must match) encodes the corpus as it
  is, not retrained."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  root = root or stdlib_root()
  packages = resolve_packages(packages)
  settings = {"vocab_size": vocab_size, "heldout_fraction": heldout_fraction,
              "max_files": max_files, "packages": packages}
  tok_path = os.path.join(workdir, "tokenizer.json")
  ddir = os.path.join(workdir, "data")
  info_path = os.path.join(ddir, "corpus.json")
  if os.path.exists(info_path) and os.path.exists(tok_path):
    with open(info_path) as f:
      info = json.load(f)
    if info["settings"] != settings:
      raise ValueError(f"{info_path} was made with {info['settings']}, not {settings}: "
                       "use another workdir or delete it")
    load = lambda name: np.load(os.path.join(ddir, f"{name}.npy")).astype(np.int32)
    return Tokenizer.from_file(tok_path), load("train"), load("heldout")
  os.makedirs(ddir, exist_ok=True)
  train = read_split("train", root, heldout_fraction, max_files, packages)
  heldout = read_split("heldout", root, heldout_fraction, max_files, packages)
  if not train or not heldout:
    raise ValueError(f"no {'train' if not train else 'held-out'} files under {root}")
  given = os.path.exists(tok_path)
  if given:
    tok = Tokenizer.from_file(tok_path)
    if tok.get_vocab_size() != vocab_size:
      raise ValueError(f"{tok_path} has {tok.get_vocab_size()} tokens, not vocab_size "
                       f"{vocab_size}")
  else:
    tok = train_tokenizer([t for _, t in train], vocab_size)
    files.save_tokenizer(tok, tok_path)
  streams = {}
  for name, docs in (("train", train), ("heldout", heldout)):
    streams[name] = encode_documents(tok, [t for _, t in docs])
    small = streams[name].astype(np.uint16) if vocab_size <= 1 << 16 else streams[name]
    files.save_npy(os.path.join(ddir, f"{name}.npy"), small)
  dists = importlib.metadata.packages_distributions()
  versions = {p: importlib.metadata.version(dists[p][0]) if p in dists else "unknown"
              for p in packages}
  info = {"settings": settings, "root": root, "package_versions": versions,
          "tokenizer_vocab": tok.get_vocab_size(), "tokenizer_given": given,
          "train_files": [r for r, _ in train], "heldout_files": [r for r, _ in heldout],
          "train_bytes": sum(len(t.encode()) for _, t in train),
          "heldout_bytes": sum(len(t.encode()) for _, t in heldout),
          "train_tokens": int(len(streams["train"])), "heldout_tokens": int(len(streams["heldout"]))}
  files.write_json(info_path, info, indent=1)  # written last: it marks the data complete
  return tok, streams["train"], streams["heldout"]
