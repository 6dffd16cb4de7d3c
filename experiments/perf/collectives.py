"""The collectives of the compiled decode programs on a mesh of forced CPU host devices, per
decode stage and per layer: what a tp / ep mesh of GPUs would communicate every step, found
without one.

  python -m experiments.perf.collectives                      # Qwen3-8B shape, tp 1, 2, 4, 8
  python -m experiments.perf.collectives --shape=qwen3-32b --batches=1
  python -m experiments.perf.collectives --shape=qwen3-30b-a3b --meshes=ep2,ep4,ep8,tp2,tp2ep4
  python -m experiments.perf.collectives --layout=replicated_attention --list

Programs: the AR decode loop and the DDTree loop at each --budgets (what bench_step times), and
bench_moe's verify forward of --verify_tokens rows (batch 1); `Program` also compiles the DDTree
step's verify stage alone (tests/test_collectives.py pins its counts). Each is lowered from
abstract inputs (ShapeDtypeStructs with the mesh's shardings) and compiled for the CPU devices;
nothing runs. The collectives are read from the HLO right after XLA's SPMD partitioner: the ops,
shapes and dtypes every backend starts from (later passes may merge independent collectives on a
GPU, and on a CPU widen bf16 all-reduces to float32). Each is attributed to its `decode.step`
stage (named scope) and, by compiling one more target layer and one more drafter layer (the
difference), to a layer. A step's totals are the rest plus the shape's real depth times the
per-layer counts. The drafter taps target layers (0, 1) (its fc [2H, H] instead of [5H, H]: the
same collectives).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import collections  # noqa: E402  (the device count must be set before jax initialises)
import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ddtree_jax import sharding
from ddtree_jax.speculative import decode
from ddtree_jax.models import decoder  # noqa: E402
from ddtree_jax.speculative import tree as tree_lib  # noqa: E402
from ddtree_jax.models import drafter as drafter_lib  # noqa: E402
from ddtree_jax.models.config import ModelConfig  # noqa: E402
from ddtree_jax.kernels import Kernels  # noqa: E402
from experiments.perf import harness  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}
STAGES = ("draft", "tree", "verify", "accept_commit")
ORDER = STAGES + ("loop", "forward", "outside")
QWEN3_32B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=5120,
                        intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8,
                        head_dim=128, rope_theta=1e6, max_position_embeddings=40960)


def shape_config(shape: str) -> ModelConfig:
  """harness.SHAPES' configs, plus Qwen3-32B's (64 layers, hidden 5120, 64 / 8 heads of 128,
  MLP 25600, vocab 151936)."""
  return QWEN3_32B if shape == "qwen3-32b" else harness.target_config(shape=shape)


def parse_mesh(text: str) -> dict[str, int]:
  """'tp2' -> {"dp": 1, "tp": 2}; 'tp2ep4' -> {"dp": 1, "tp": 2, "ep": 4}."""
  axes = dict(re.findall(r"([a-z]+)(\d+)", text))
  if not axes or "".join(f"{k}{v}" for k, v in axes.items()) != text:
    raise ValueError(f"mesh {text!r}: expected e.g. tp2, ep4, tp2ep4, dp2tp4")
  return {"dp": 1, "tp": 1} | {k: int(v) for k, v in axes.items()}


# --------------------------------------------------------------------------------------------
# Reading collectives out of HLO text

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\(.*?\)|\S+) ([a-z\-]+)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str        # one of KINDS
  types: str       # result type(s), e.g. "bf16[1,33,4096]"
  nbytes: int      # result bytes (an all-gather's gathered result; an all-reduce's payload)
  group: int       # devices per replica group
  stage: str       # decode stage, "forward" (no decode loop) or "outside" (not in the loop)
  source: str      # the tail of the op's op_name


def _group_size(line: str) -> int:
  """Devices per replica group of a collective's HLO line."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    # each axis is 'tp' (all of it) or 'tp':(pre)size (a sub-axis of that size)
    return int(np.prod([int(sub) if sub else sizes[name]
                        for name, sub in re.findall(r"'(\w+)'(?::\(\d+\)(\d+))?", m.group(2))]))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  return len(m.group(1).split(",")) if m else 0  # 0: not read (e.g. a collective-permute)


def collectives(hlo: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text (each counted once: a loop body's as
  one step's), with its stage from its own op_name or the nearest caller's. Those over groups of
  one device (a psum over a mesh axis of size 1) are left out: they move nothing, and XLA's
  all-reduce simplifier removes them."""
  comps, current = {}, None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
    elif current is not None:
      comps[current].append(line)
  callers = {}
  for name, lines in comps.items():
    for line in lines:
      op = re.search(r'op_name="([^"]*)"', line)
      called = _CALLS.findall(line)
      for b in _BRANCHES.findall(line):
        called += [c.strip().lstrip("%") for c in b.split(",")]
      for c in called:
        callers.setdefault(c, (name, op.group(1) if op else ""))

  def stage_of(op_name: str, comp: str) -> str:
    seen = set()
    while True:
      for s in STAGES:
        if f"/{s}/" in op_name or op_name.endswith(f"/{s}"):
          return s
      if "/while/" in op_name:
        return "loop"
      if op_name.startswith("jit("):
        return "forward" if "decode_loop" not in op_name else "outside"
      if comp not in callers or comp in seen:
        return "outside"
      seen.add(comp)
      comp, op_name = callers[comp]

  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m or m.group(2).removesuffix("-start") not in KINDS:
        continue
      kind = m.group(2).removesuffix("-start")
      arrays = _ARRAY.findall(m.group(1))
      nbytes = sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                   for t, dims in arrays)
      op = re.search(r'op_name="([^"]*)"', line)
      op_name = op.group(1) if op else ""
      group = _group_size(line)
      if group != 1:
        out.append(Collective(kind, " ".join(f"{t}[{d}]" for t, d in arrays), nbytes, group,
                              stage_of(op_name, name), "/".join(op_name.split("/")[-2:])))
  return out


def compile_partitioned(lowered) -> tuple[str, str]:
  """(the HLO after SPMD partitioning, the final compiled HLO) of a jax Lowered."""
  with tempfile.TemporaryDirectory() as tmp:
    compiled = lowered.compile(compiler_options={"xla_dump_to": tmp,
                                                 "xla_dump_hlo_pass_re": "spmd-partitioning"})
    files = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
    partitioned = open(files[-1]).read() if files else compiled.as_text()
  return partitioned, compiled.as_text()


# --------------------------------------------------------------------------------------------
# The programs


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program over `layers` target and `draft_layers` drafter layers: the AR ("ar")
  or DDTree ("ddtree", budget) decode loop, the DDTree step's verify stage alone ("verify", of
  budget + 1 nodes) or bench_moe's verify forward ("forward", of `tokens` rows)."""
  shape: ModelConfig
  mesh: dict
  method: str
  batch: int = 1
  budget: int = 0
  tokens: int = 0
  layers: int = 2
  draft_layers: int = 1
  drafter: str = "bf16"
  attention: str = "xla"
  rules: sharding.ShardingRules = sharding.DEFAULT_RULES
  prefix: int = 1024


def _target_cfg(p: Program) -> ModelConfig:
  cfg = p.shape
  moe = tuple(range(p.layers)) if cfg.moe_layers else ()
  return dataclasses.replace(cfg, num_layers=p.layers, moe_layers=moe)


def _drafter(p: Program, cfg: ModelConfig, tparams):
  base = harness.drafter_config(p.shape)
  dcfg = dataclasses.replace(base, layers=dataclasses.replace(base.layers,
                                                              num_layers=p.draft_layers),
                             target_layer_ids=(0, 1))
  h = cfg.hidden_size

  def init():
    layers = decoder.init_params(dcfg.layers, jax.random.key(1)).layers
    return drafter_lib.DrafterParams(fc=jnp.zeros((2 * h, h), jnp.bfloat16),
                                     hidden_norm=jnp.ones((h,), jnp.bfloat16), layers=layers,
                                     final_norm=jnp.ones((h,), jnp.bfloat16))
  dparams = jax.eval_shape(init)
  base_name, _, vocab = p.drafter.partition(":v")
  if base_name == "int8":
    dparams = jax.eval_shape(drafter_lib.quantize_int8, dparams, tparams)
  if vocab:
    dparams = jax.eval_shape(lambda d, t: drafter_lib.restrict_vocab(d, t, np.arange(int(vocab))),
                             dparams, tparams)
  return dparams, dcfg


def lower(p: Program):
  """The jax Lowered of program p with abstract inputs laid out on p.mesh by p.rules (no mesh
  for one device, as bench_step runs tp=1)."""
  mesh = sharding.make_mesh(p.mesh) if np.prod(list(p.mesh.values())) > 1 else None
  put = lambda t: t if t is None or mesh is None else jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), t,
      sharding.shardings(t, mesh, p.rules))
  cfg = _target_cfg(p)
  tparams = put(jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0))))
  kern = Kernels(p.attention, mesh, p.rules)
  dparams, dcfg = (None, None) if p.method in ("ar", "forward") else _drafter(p, cfg, tparams)
  lc = decode.LoopConfig(method="ddtree" if p.method == "verify" else p.method,
                         max_new_tokens=17, num_drafts=0 if dcfg is None else dcfg.num_drafts,
                         budget=p.budget, kernels=kern)
  state = harness.Case.make(None, cfg, None, dcfg, lc, p.batch, p.prefix,
                            p.tokens + 16).state_shape()
  if p.method in ("ar", "ddtree"):
    return decode.decode_loop.lower(tparams, put(dparams), state, tcfg=cfg, dcfg=dcfg, lc=lc)
  b, t = p.batch, p.tokens or p.budget + 1
  dp = mesh is not None and mesh.shape.get("dp", 1) > 1 and b % mesh.shape["dp"] == 0
  rows = lambda dtype, *s: jax.ShapeDtypeStruct((b,) + s, dtype, sharding=None if mesh is None
                                                else NamedSharding(mesh, P("dp" if dp else None)))
  if p.method == "forward":  # bench_moe's verify section: forward + lm_head + argmax
    def forward(tp, toks, pos, cache, mask):
      hidden, _, _ = decoder.forward(tp, cfg, toks, pos, cache, mask, kernels=kern)
      return jnp.argmax(decoder.lm_head(tp, hidden), axis=-1)
    return jax.jit(forward).lower(tparams, rows(jnp.int32, t), rows(jnp.int32, t), state.cache,
                                  rows(jnp.bool_, t, t))
  # the DDTree step's verify stage alone (profiling.compile_stages' "verify" program)
  tree = tree_lib.DraftTree(tokens=rows(jnp.int32, t), parents=rows(jnp.int32, t),
                            depths=rows(jnp.int32, t), scores=rows(jnp.float32, t),
                            visibility=rows(jnp.bool_, t, t))
  verify = jax.jit(lambda tp, st, tr: decode.verify_and_pick(tp, cfg, dcfg, lc, st, tr,
                                                             jax.random.key(0)))
  return verify.lower(tparams, state, tree)


def count(p: Program) -> tuple[list[Collective], int]:
  """(p's collectives after SPMD partitioning, the number of collectives of its final HLO)."""
  partitioned, final = compile_partitioned(lower(p))
  return collectives(partitioned), len(collectives(final))


def _sub(a: collections.Counter, b: collections.Counter) -> collections.Counter:
  diff = collections.Counter(a)
  diff.subtract(b)
  if any(v < 0 for v in diff.values()):
    raise ValueError(f"one more layer removed collectives: {dict(diff)}")
  return +diff


def breakdown(p: Program) -> dict:
  """p's collectives split into per target layer, per drafter layer and the rest (Counters of
  Collective), from p and p with one more layer of each; and the final HLO's count."""
  base, final = count(p)
  base = collections.Counter(base)
  layer = _sub(collections.Counter(count(dataclasses.replace(p, layers=p.layers + 1))[0]), base)
  draft = collections.Counter()
  if p.method == "ddtree":
    draft = _sub(collections.Counter(
        count(dataclasses.replace(p, draft_layers=p.draft_layers + 1))[0]), base)
  rest = base.copy()
  for _ in range(p.layers):
    rest.subtract(layer)
  for _ in range(p.draft_layers):
    rest.subtract(draft)
  return {"layer": layer, "draft_layer": draft, "rest": +rest, "final_count": final,
          "partitioned_count": sum(base.values())}


def program_name(p: Program) -> str:
  return {"ar": "ar", "ddtree": f"ddtree{p.budget}", "verify": f"verify B={p.budget}",
          "forward": f"forward T={p.tokens}"}[p.method]


def step_total(b: dict, layers: int, draft_layers: int) -> collections.Counter:
  """A step's collectives at a real depth."""
  total = collections.Counter(b["rest"])
  for c, n in b["layer"].items():
    total[c] += n * layers
  for c, n in b["draft_layer"].items():
    total[c] += n * draft_layers
  return total


def kinds(counter: collections.Counter) -> str:
  """'AR 2, AG 1' (counts by kind)."""
  by = collections.Counter()
  for c, n in counter.items():
    by[c.kind] += n
  return ", ".join(f"{SHORT[k]} {by[k]}" for k in KINDS if by[k]) or "-"


def nbytes(counter: collections.Counter) -> int:
  return sum(c.nbytes * n for c, n in counter.items())


def describe(counter: collections.Counter) -> list[str]:
  """One line per distinct collective: count, kind, types, group size, stage, source."""
  rank = lambda c: ORDER.index(c.stage) if c.stage in ORDER else len(ORDER)
  return [f"{n:>4} x {SHORT[c.kind]:<3} {c.types:<34} /{c.group:<2} {c.stage:<13} {c.source}"
          for c, n in sorted(counter.items(), key=lambda cn: (rank(cn[0]), cn[0].source))]


# --------------------------------------------------------------------------------------------
# The table

FLAGS = flags.FLAGS


def define_flags():
  """The script's flags (defined when run, so that tests can import this module)."""
  flags.DEFINE_string("shape", "qwen3-8b", "qwen3-8b, qwen3-32b or qwen3-30b-a3b (MoE)")
  flags.DEFINE_string("meshes", "tp1,tp2,tp4,tp8", "comma list of meshes, e.g. tp2,ep4,tp2ep4")
  flags.DEFINE_string("batches", "1,8", "batch sizes of the decode loops")
  flags.DEFINE_string("budgets", "32", "DDTree budgets ('' = AR only)")
  flags.DEFINE_string("verify_tokens", "", "MoE shapes: verify forwards of T rows, batch 1 "
                      "(bench_moe's verify section), e.g. 17,65")
  flags.DEFINE_string("drafter", "bf16", "bf16, int8 or either with :vN (harness.drafter_variants)")
  flags.DEFINE_string("attention", "xla", "xla or pallas (interpret mode on CPU; per-shard "
                      "kernels either way, so the same collectives)")
  flags.DEFINE_string("layout", "split", f"sharding.LAYOUTS: {', '.join(sharding.LAYOUTS)}")
  flags.DEFINE_bool("list", False, "list every collective of each program")
  flags.DEFINE_string("json_out", "", "append one JSON line per program here")


def rules_for(cfg: ModelConfig, mesh: dict, layout: str) -> sharding.ShardingRules:
  """The layout's rules, with kv heads replicated where tp does not divide them."""
  rules = sharding.LAYOUTS[layout]
  if rules.kv_heads and cfg.num_kv_heads % mesh.get("tp", 1):
    rules = dataclasses.replace(rules, kv_heads=None)
  return rules


def main(_):
  cfg = shape_config(FLAGS.shape)
  dlayers = harness.drafter_config(cfg).layers.num_layers
  programs = []
  for text in FLAGS.meshes.split(","):
    mesh = parse_mesh(text)
    kw = dict(shape=cfg, mesh=mesh, drafter=FLAGS.drafter, attention=FLAGS.attention,
              rules=rules_for(cfg, mesh, FLAGS.layout))
    for b in harness.ints(FLAGS.batches):
      programs.append(Program(method="ar", batch=b, **kw))
      programs += [Program(method="ddtree", batch=b, budget=n, **kw)
                   for n in harness.ints(FLAGS.budgets)]
    programs += [Program(method="forward", tokens=t, **kw)
                 for t in harness.ints(FLAGS.verify_tokens)]
  print(f"{FLAGS.shape}: {cfg.num_layers} layers (+ {dlayers} drafter layers), layout "
        f"{FLAGS.layout}, drafter {FLAGS.drafter}; counts per step after SPMD partitioning")
  head = (f"{'mesh':<8}{'program':<13}{'batch':>5}  {'per layer':<14}{'per drafter layer':<19}"
          f"{'rest':<18}{'step':<22}{'step KB':>9}")
  print(head)
  for p in programs:
    b = breakdown(p)
    total = step_total(b, cfg.num_layers, dlayers if p.method == "ddtree" else 0)
    name = program_name(p)
    mesh = "".join(f"{k}{v}" for k, v in p.mesh.items() if v > 1 or k == "tp")
    print(f"{mesh:<8}{name:<13}{p.batch:>5}  {kinds(b['layer']):<14}{kinds(b['draft_layer']):<19}"
          f"{kinds(b['rest']):<18}{kinds(total):<22}{nbytes(total) / 1024:>9.1f}", flush=True)
    if FLAGS.list:
      for part in ("layer", "draft_layer", "rest"):
        for line in describe(b[part]):
          print(f"      {part:<12}{line}")
      print(f"      final HLO: {b['final_count']} collectives at {p.layers} layers "
            f"(partitioned: {b['partitioned_count']})")
    if FLAGS.json_out:
      row = {"shape": FLAGS.shape, "layout": FLAGS.layout, "drafter": FLAGS.drafter,
             "mesh": p.mesh, "program": name, "batch": p.batch,
             **{part: [dataclasses.asdict(c) | {"count": n} for c, n in b[part].items()]
                for part in ("layer", "draft_layer", "rest")},
             "step_count": sum(total.values()), "step_bytes": nbytes(total)}
      with open(FLAGS.json_out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)
