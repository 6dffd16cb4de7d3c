"""Mutation check: plants known bugs, one at a time, in a copy of the repository and runs the tests
there, to show which tests catch each one (proof that the suite fails when the code is wrong).

  .venv/bin/python -m experiments.mutations --list
  .venv/bin/python -m experiments.mutations --check            # anchors and import path only
  .venv/bin/python -m experiments.mutations --only=non_first_child_never_accepted \
      --tests=tests/test_decode.py
  .venv/bin/python -m experiments.mutations --all              # every mutation on tests/, -n 2

Each mutation replaces one exact text (found exactly once, else the script stops) in a fresh copy
of the tracked and untracked-but-not-ignored files. A baseline run over the same test files comes
first: a test that fails without any mutation does not count as catching one. Exits non-zero when
a mutation survives (no test beyond the baseline's failures fails) or the baseline fails. Writes
results.md (the table and each run's pytest tail), results.json and every run's full pytest
output to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(REPO, ".venv", "bin", "python")

_LIST = flags.DEFINE_bool("list", False, "print the mutations and exit")
_ONLY = flags.DEFINE_list("only", [], "run these mutations only (comma list of names)")
_CHECK = flags.DEFINE_bool("check", False, "apply each mutation to a copy and check the anchors "
                           "and that the copy imports its own package; no pytest")
_ALL = flags.DEFINE_bool("all", False, "run the whole tests/ directory (with -n 2) for every "
                         "mutation instead of its focused test files")
_TESTS = flags.DEFINE_list("tests", [], "run these test files (or ids) for every mutation instead "
                           "of its focused list")
_MAXFAIL = flags.DEFINE_integer("maxfail", 0, "pytest --maxfail for mutation runs (0: run all, so "
                                "every catching test is listed; the baseline always runs all)")
_WORKERS = flags.DEFINE_integer("workers", 0, "pytest-xdist workers (-n); 0: none, 2 under --all")
_PYTEST_ARGS = flags.DEFINE_string("pytest_args", "", "extra pytest arguments, e.g. '-k budget'")
_BASELINE = flags.DEFINE_bool("baseline", True, "run the unmutated copy first")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 7200, "limit on one pytest run (seconds)")
_OUT = flags.DEFINE_string("out", os.path.join(REPO, "out", "mutations"), "output folder")
_KEEP = flags.DEFINE_bool("keep", False, "keep the temporary copies (their paths are printed)")
_TAIL = flags.DEFINE_integer("tail_lines", 60, "pytest output lines kept per run in results.md")

# The tests each kind of bug should trip (the whole suite: --all).
DRAFT_TESTS = ("tests/test_default_model.py::test_default_pair_is_shipped_and_lossless",
               "tests/test_edges.py::test_nothing_written_outside_own_rows")
ACCEPT_TESTS = ("tests/test_decode.py::test_ddtree_is_lossless",
                "tests/test_moe.py::test_speculative_decoding_is_lossless",
                "tests/test_mla.py::test_speculative_decoding_is_lossless")
SAMPLING_TESTS = ("tests/test_sampling.py",)
QUANT_DTYPE_TESTS = ("tests/test_quant_gemm.py::test_each_format_computes_in_the_dtype_asked",
                     "tests/test_quantized_targets.py::test_float32_logits_are_the_dequantized_"
                     "models")


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str
  doc: str        # one line: what is wrong
  path: str       # file of the repository
  anchor: str     # exact text, found exactly once in `path`
  replacement: str
  tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "draft_rows_zeroed",
        "decode step commits zero K/V as the drafter's context rows (lengths still advance)",
        "ddtree_jax/speculative/decode.py",
        "    dk, dv = dcfg.context(dparams, rows, pos)\n",
        "    dk, dv = dcfg.context(dparams, rows, pos)\n"
        "    dk, dv = jax.tree.map(jnp.zeros_like, (dk, dv))\n",
        DRAFT_TESTS),
    Mutation(
        "draft_rows_shifted",
        "each committed drafter row takes the target features of the next committed path node "
        "(one token ahead; the last committed row keeps its own)",
        "ddtree_jax/speculative/decode.py",
        "    rows = jnp.take_along_axis(taps, src[:, :, None], axis=1)\n",
        "    ahead = jnp.minimum(jnp.arange(src.shape[1])[None] + 1, (count - 1)[:, None])\n"
        "    ahead = jnp.take_along_axis(src, jnp.maximum(ahead, 0), axis=1)  # next path node\n"
        "    rows = jnp.take_along_axis(taps, ahead[:, :, None], axis=1)\n",
        DRAFT_TESTS),
    Mutation(
        "draft_rows_not_committed",
        "the decode step leaves the drafter's cache as it was (no rows, lengths not advanced)",
        "ddtree_jax/speculative/decode.py",
        "    draft_cache = decoder.commit(draft_cache, decoder.Pending(dk, dv), ident, count)\n",
        "    draft_cache = state.draft_cache\n",
        DRAFT_TESTS),
    Mutation(
        "held_rows_kept_on_insert",
        "budget='auto' in the slot engine: a request that takes a slot keeps the features its "
        "predecessor's undrafted steps held (they are committed into its drafter context)",
        "ddtree_jax/serving/programs.py",
        "                               predicted=put(auto.predicted, one.auto.predicted, 1),\n"
        "                               held=put(auto.held, one.auto.held, 0))  # the old row's: dropped\n",
        "                               predicted=put(auto.predicted, one.auto.predicted, 1))\n",
        ("tests/test_slots_engine.py::test_auto_backing_off_keeps_each_slots_drafter_context",)),
    Mutation(
        "held_rows_one_position_late",
        "budget='auto': the features undrafted steps held are committed one position after "
        "where they belong",
        "ddtree_jax/speculative/decode.py",
        "  dk, dv = dcfg.context(dparams, auto.held_taps, cache.lens[:, None] + at)\n",
        "  dk, dv = dcfg.context(dparams, auto.held_taps, cache.lens[:, None] + at + 1)\n",
        ("tests/test_auto_budget.py::test_ar_steps_advance_the_drafters_context",)),
    Mutation(
        "non_first_child_never_accepted",
        "accept: a node matches only if it is also its parent's first (lowest-index) child",
        "ddtree_jax/speculative/verify.py",
        "  matched = (tokens == post_at_parent) | (parents < 0)\n",
        "  n = tokens.shape[1]\n"
        "  earlier = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]  # [N, N]: m < n\n"
        "  siblings = parents[:, :, None] == parents[:, None, :]\n"
        "  first = ~jnp.any(siblings & earlier[None], axis=-1)  # no earlier sibling\n"
        "  matched = ((tokens == post_at_parent) & first) | (parents < 0)\n",
        ACCEPT_TESTS),
    Mutation(
        "biased_non_root_sample",
        "T > 0, decode path: at non-root nodes with a child, the target's sample is replaced by "
        "the first child's token with probability 0.05 (the root stays unbiased)",
        "ddtree_jax/speculative/decode.py",
        "  if pick is None:\n"
        "    pick = lambda x, k: verify.pick(x, lc.temperature, k, lc.top_k, lc.top_p)\n",
        "  if pick is None:\n"
        "    def pick(x, k):\n"
        "      post = verify.pick(x, lc.temperature, k, lc.top_k, lc.top_p)\n"
        "      if lc.temperature == 0.0:\n"
        "        return post\n"
        "      n = tree.parents.shape[1]\n"
        "      child = tree.parents[:, None, :] == jnp.arange(n)[None, :, None]  # [B, N, N]\n"
        "      first = jnp.argmax(child, axis=-1)  # each node's first child (0: none)\n"
        "      u = jax.random.uniform(jax.random.fold_in(k, 1), post.shape)\n"
        "      bias = (u < 0.05) & (first > 0) & (jnp.arange(n) > 0)[None]\n"
        "      return jnp.where(bias, jnp.take_along_axis(tree.tokens, first, axis=1), post)\n",
        SAMPLING_TESTS),
    Mutation(
        "top_p_at_root_only",
        "verify.pick on tree logits [B, N, V]: top-p filters the root only; non-root nodes sample "
        "without it (prefill's [B, V] pick unchanged)",
        "ddtree_jax/speculative/verify.py",
        "  filtered = filter_logits(logits, temperature, top_k, top_p)\n",
        "  filtered = filter_logits(logits, temperature, top_k, top_p)\n"
        "  if logits.ndim == 3:\n"
        "    rest = filter_logits(logits[:, 1:], temperature, top_k)  # no top-p\n"
        "    filtered = filtered.at[:, 1:].set(rest)\n",
        SAMPLING_TESTS),
    Mutation(
        "int4_kernel_weights_in_bfloat16",
        "the int4 expert kernels' float32 form rounds each dequantized weight to bfloat16 "
        "before its dot (a bfloat16 product in a float32 run)",
        "ddtree_jax/pallas/quant_gemm.py",
        "          w = (q * scale[h]).astype(x.dtype)\n",
        "          w = (q * scale[h]).astype(jnp.bfloat16).astype(x.dtype)\n",
        QUANT_DTYPE_TESTS),
    Mutation(
        "dequantize_in_bfloat16",
        "quant.dequantize forms fp8 weights in bfloat16 whatever dtype it is asked for "
        "(XLA's expert form and every reference built on it)",
        "ddtree_jax/models/quant.py",
        "    return (w.q.astype(jnp.float32) * scale).astype(dtype)\n",
        "    return (w.q.astype(jnp.float32) * scale).astype(jnp.bfloat16).astype(dtype)\n",
        QUANT_DTYPE_TESTS),
)


def _git_files():
  """Tracked files that exist, plus untracked files git does not ignore (paths from REPO)."""
  listed = []
  for args in (["ls-files", "-z"], ["ls-files", "-z", "--others", "--exclude-standard"]):
    out = subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True).stdout
    listed += [p for p in out.decode().split("\0") if p]
  return sorted({p for p in listed if os.path.isfile(os.path.join(REPO, p))})


def make_copy(files, label):
  """A fresh copy of `files` under a new temporary folder; returns its root."""
  root = tempfile.mkdtemp(prefix=f"ddtree_mut_{label}_")
  for p in files:
    dst = os.path.join(root, p)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(os.path.join(REPO, p), dst)
  return root


def apply(mutation: Mutation, root):
  """Replaces the mutation's anchor in the copy at root; stops when it is not found exactly once."""
  path = os.path.join(root, mutation.path)
  with open(path) as f:
    text = f.read()
  n = text.count(mutation.anchor)
  if n != 1:
    raise SystemExit(f"{mutation.name}: anchor found {n} times in {mutation.path} (expected 1): "
                     f"the code moved, update the mutation\n{mutation.anchor}")
  with open(path, "w") as f:
    f.write(text.replace(mutation.anchor, mutation.replacement))


def _env(root):
  env = dict(os.environ)
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  env.pop("PYTEST_ADDOPTS", None)
  return env


def check_import(root):
  """Imports the copy's package (and its decode/verify modules, so a mutation that does not
  compile fails here) as pytest will; stops unless it comes from the copy."""
  code = ("import ddtree_jax, ddtree_jax.speculative.decode, ddtree_jax.speculative.verify; "
          "print(ddtree_jax.__file__); print(ddtree_jax.speculative.decode.__file__)")
  r = subprocess.run([PYTHON, "-c", code], cwd=root, env=_env(root), capture_output=True,
                     text=True, check=False)
  if r.returncode:
    raise SystemExit(f"importing the copy at {root} failed:\n{r.stderr[-3000:]}")
  want = os.path.realpath(root) + os.sep
  for got in r.stdout.split():
    if not os.path.realpath(got).startswith(want):
      raise SystemExit(f"the copy at {root} imports ddtree_jax from {got}, not its own package")
  return r.stdout.split()[0]


_SUMMARY_RE = re.compile(r"^(FAILED|ERROR) (\S+)")
_COUNT_RE = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)\b")


def parse(output):
  """(failing test ids, counts) from pytest -rfE output."""
  ids = []
  for line in output.splitlines():
    m = _SUMMARY_RE.match(line)
    if m and m.group(2) not in ids:
      ids.append(m.group(2))
  counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  final = [l for l in output.splitlines() if re.search(r"\b(passed|failed|error|no tests ran)", l)]
  if final:
    for n, kind in _COUNT_RE.findall(final[-1]):
      kind = "error" if kind.startswith("error") else kind
      if kind in counts:
        counts[kind] = int(n)
  return ids, counts


def run_pytest(root, tests, maxfail):
  """Runs pytest on `tests` in the copy at root; returns (ids, counts, seconds, rc, output)."""
  cmd = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
         f"--basetemp={os.path.join(root, '.pytest_tmp')}"]
  workers = _WORKERS.value or (2 if _ALL.value else 0)
  if workers:
    cmd += ["-n", str(workers), "--dist", "loadfile"]
  if maxfail:
    cmd += [f"--maxfail={maxfail}"]
  cmd += _PYTEST_ARGS.value.split() + list(tests)
  print("  $ " + " ".join(cmd), flush=True)
  t0 = time.perf_counter()
  try:
    r = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True,
                       timeout=_TIMEOUT.value, check=False)
    rc, output = r.returncode, r.stdout + r.stderr
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rc, output = -1, out + f"\n[timed out after {_TIMEOUT.value} s]\n"
  seconds = time.perf_counter() - t0
  ids, counts = parse(output)
  if rc not in (0, 1) and not ids:  # collection error, usage error, crash, timeout
    ids = [f"<pytest exit {rc}>"]
  return ids, counts, seconds, rc, output


def _tail(text, n):
  return "\n".join(text.splitlines()[-n:])


def table(rows):
  head = ["| mutation | caught | failed | passed | errors | seconds | catching tests |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
  body = []
  for r in rows:
    shown = r["catching"][:6] + ([f"... {len(r['catching']) - 6} more"]
                                 if len(r["catching"]) > 6 else [])
    body.append(f"| {r['name']} | {r['caught']} | {r['counts']['failed']} | "
                f"{r['counts']['passed']} | {r['counts']['error']} | {r['seconds']:.0f} | "
                f"{'<br>'.join(f'`{t}`' for t in shown) or '-'} |")
  return "\n".join(head + body)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  by_name = {m.name: m for m in MUTATIONS}
  if _LIST.value:
    for m in MUTATIONS:
      print(f"{m.name}: {m.doc}\n  {m.path}; tests: {' '.join(m.tests)}")
    return
  unknown = [n for n in _ONLY.value if n not in by_name]
  if unknown:
    raise app.UsageError(f"unknown mutations {unknown}; --list shows them")
  chosen = [by_name[n] for n in _ONLY.value] if _ONLY.value else list(MUTATIONS)
  tests_of = lambda m: (["tests"] if _ALL.value else list(_TESTS.value) or list(m.tests))
  files = _git_files()
  copies = []

  def fresh(label, mutation=None):
    root = make_copy(files, label)
    copies.append(root)
    if mutation is not None:
      apply(mutation, root)
    where = check_import(root)
    print(f"{label}: copy {root} imports {where}", flush=True)
    return root

  try:
    if _CHECK.value:
      fresh("baseline")
      for m in chosen:
        fresh(m.name, m)
      print(f"check: {len(chosen)} mutations apply (each anchor found once) and every copy "
            "imports its own package")
      return

    os.makedirs(_OUT.value, exist_ok=True)
    union = list(dict.fromkeys(t for m in chosen for t in tests_of(m)))
    baseline_fail, results = set(), []
    if _BASELINE.value:
      print(f"baseline on {' '.join(union)}", flush=True)
      ids, counts, seconds, rc, output = run_pytest(fresh("baseline"), union, 0)
      baseline_fail = set(ids)
      with open(os.path.join(_OUT.value, "baseline.txt"), "w") as f:
        f.write(output)
      results.append({"name": "(baseline)", "caught": "n/a", "counts": counts, "seconds": seconds,
                      "catching": sorted(ids), "failing": sorted(ids), "rc": rc,
                      "tests": union, "tail": _tail(output, _TAIL.value)})
      print(f"baseline: {counts} in {seconds:.0f} s" +
            (f"; FAILING WITHOUT A MUTATION: {sorted(ids)}" if ids else ""), flush=True)
    for m in chosen:
      print(f"{m.name}: {m.doc}", flush=True)
      tests = tests_of(m)
      ids, counts, seconds, rc, output = run_pytest(fresh(m.name, m), tests, _MAXFAIL.value)
      catching = [t for t in ids if t not in baseline_fail]
      with open(os.path.join(_OUT.value, f"{m.name}.txt"), "w") as f:
        f.write(output)
      results.append({"name": m.name, "caught": "yes" if catching else "NO", "counts": counts,
                      "seconds": seconds, "catching": catching, "failing": ids, "rc": rc,
                      "tests": tests, "doc": m.doc, "path": m.path, "anchor": m.anchor,
                      "replacement": m.replacement, "tail": _tail(output, _TAIL.value)})
      print(f"{m.name}: caught {'yes' if catching else 'NO'}, {counts} in {seconds:.0f} s; "
            f"catching: {catching}", flush=True)
  finally:
    if not _KEEP.value:
      for root in copies:
        shutil.rmtree(root, ignore_errors=True)

  md = table(results)
  print("\n" + md)
  sections = [f"# Mutation check\n\n`{' '.join(sys.argv)}`\n\n{md}\n"]
  for r in results:
    sections.append(f"## {r['name']}\n\n{r.get('doc', 'no mutation')}\n\ntests: "
                    f"`{' '.join(r['tests'])}`, pytest exit {r['rc']}\n\n"
                    + (f"{r['path']}: replaces\n\n```python\n{r['anchor']}```\n\nwith\n\n"
                       f"```python\n{r['replacement']}```\n\n" if "path" in r else "")
                    + f"pytest tail:\n\n```\n{r['tail']}\n```\n")
  with open(os.path.join(_OUT.value, "results.md"), "w") as f:
    f.write("\n".join(sections))
  with open(os.path.join(_OUT.value, "results.json"), "w") as f:
    json.dump([{k: v for k, v in r.items() if k != "tail"} for r in results], f, indent=1)
  print(f"\nwrote {os.path.join(_OUT.value, 'results.md')}")

  survived = [r["name"] for r in results if r["caught"] == "NO"]
  problems = []
  if baseline_fail:
    problems.append(f"the baseline (no mutation) fails: {sorted(baseline_fail)}")
  if survived:
    problems.append(f"mutations not caught by any test: {survived}")
  if problems:
    raise SystemExit("; ".join(problems))


if __name__ == "__main__":
  app.run(main)
