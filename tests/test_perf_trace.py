"""experiments/perf/trace.py (profile_step's reader): kernel times from a Perfetto trace."""

import jax
import jax.numpy as jnp
import pytest

from experiments.perf import trace


def _gpu_trace():
  m = lambda pid, tid, what, name: {"ph": "M", "pid": pid, "tid": tid, "name": what,
                                    "args": {"name": name}}
  x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts,
                                       "dur": dur, "args": {"hlo_op": name + ".op"}}
  return {"traceEvents": [
      m(1, 0, "process_name", "/host:CPU"), m(2, 0, "process_name", "/device:GPU:0"),
      m(2, 7, "thread_name", "Stream #14(Compute)"), m(2, 8, "thread_name", "XLA Ops"),
      m(2, 9, "thread_name", "XLA Modules"),
      x(1, 0, "PjitFunction(decode_loop)", 0, 100),                    # host: ignored
      x(2, 9, "jit_decode_loop", 0, 60),                               # module line: ignored
      x(2, 8, "fusion.3", 0, 10),                                      # op line: ignored
      x(2, 7, "triton_gemm_dot_1", 0, 10), x(2, 7, "triton_gemm_dot_1", 20, 10),
      x(2, 7, "tree_attention", 30, 5), x(2, 7, "ncclDevKernel_AllReduce_Sum_bf16", 35, 4),
      x(2, 7, "sort_topk_fusion", 39, 1), x(2, 7, "loop_add_fusion", 40, 10)]}


def test_kernel_events_take_gpu_streams_only_and_kinds():
  ev = trace.kernel_events(_gpu_trace())
  assert sorted((n, d) for n, d, _ in ev) == sorted([
      ("triton_gemm_dot_1", 10.0), ("triton_gemm_dot_1", 10.0), ("tree_attention", 5.0),
      ("ncclDevKernel_AllReduce_Sum_bf16", 4.0), ("sort_topk_fusion", 1.0),
      ("loop_add_fusion", 10.0)])
  assert all(op == n + ".op" for n, _, op in ev)
  rows, kinds, per_step = trace.summarize(ev, steps=2, top=2)
  assert per_step == pytest.approx(20.0)
  assert rows[0] == ("triton_gemm_dot_1", 1.0, 10.0, pytest.approx(0.5))
  assert {k: us for k, _, us, _ in kinds} == {"matmul": 10.0, "other": 5.0, "attention": 2.5,
                                              "collective": 2.0, "top-k / sort": 0.5}


def test_enclosing_events_are_not_counted_twice():
  x = lambda name, ts, dur: {"ph": "X", "pid": 1, "tid": 1, "name": name, "ts": ts, "dur": dur,
                             "args": {"hlo_op": name}}
  events = {"traceEvents": [x("while.1", 0, 100), x("fusion.1", 10, 30), x("fusion.2", 50, 20),
                            x("fusion.3", 65, 10)]}  # overlaps fusion.2 (PDL) without nesting
  assert sorted(trace.kernel_events(events)) == [
      ("fusion.1", 30.0, "fusion.1"), ("fusion.2", 20.0, "fusion.2"),
      ("fusion.3", 10.0, "fusion.3")]


def test_reads_a_real_cpu_trace(tmp_path):
  f = jax.jit(lambda a: jnp.sort(a * 2.0) @ a)
  a = jnp.ones((256,))
  jax.block_until_ready(f(a))
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    jax.block_until_ready(f(a))
  ev = trace.kernel_events(trace.read_trace(str(tmp_path)))
  assert ev and all(d >= 0 for _, d, _ in ev)
  assert any(trace.kind(n) == "top-k / sort" for n, _, _ in ev)
  with pytest.raises(FileNotFoundError, match="no .*trace"):
    trace.read_trace(str(tmp_path / "empty"))


def test_stage_table_attributes_kernels_to_named_scopes(tmp_path):
  """Kernels are timed per decode stage through the named scope in their HLO op's metadata."""
  def f(a):
    with jax.named_scope("tree"):
      s = jnp.sort(a, axis=-1)
    with jax.named_scope("verify"):
      return jnp.tanh(s @ a.T)
  g = jax.jit(f).lower(jnp.ones((128, 128))).compile()
  stages = trace.op_stages(g.as_text())
  assert {"tree", "verify"} <= set(stages.values())
  a = jax.random.normal(jax.random.key(0), (128, 128))
  jax.block_until_ready(g(a))
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    jax.block_until_ready(g(a))
  table = trace.stage_table(trace.kernel_events(trace.read_trace(
      str(tmp_path))), stages, steps=1)
  names = [s for s, _, _, _ in table]
  assert "tree" in names and "verify" in names, table
  assert sum(share for _, _, share, _ in table) == pytest.approx(1.0)
  assert all(sum(kinds.values()) == pytest.approx(us) for _, us, _, kinds in table)
  # made-up kernels, by name and by op: a kernel of no known stage joins the one before it
  fake = [("mystery_kernel", 3.0, ""), ("x", 1.0, "fusion.7"), ("MemcpyD2D", 2.0, ""),
          ("gemm_y", 2.0, "gemm.1"), ("z", 2.0, "fusion.9")]
  assert trace.stage_table(fake, {"fusion_7": "draft", "gemm_1": "?", "fusion.9": "tree"},
                                  steps=2) == [
      ("draft", 2.5, 0.5, {"other": 1.5, "matmul": 1.0}), ("tree", 1.0, 0.2, {"other": 1.0}),
      ("unattributed", 1.5, 0.3, {"other": 1.5})]


def test_op_stages_reads_scopes_and_deduplicated_fusions():
  hlo = """
  %fusion.3 = f32[2] fusion(%p), calls=%c, metadata={op_name="jit(f)/while/body/tree/sort"}
  %gemm.4 = f32[2] fusion(%p), calls=%d, metadata={op_name="jit(f)/while/body/verify/dot" deduplicated_name="gemm.4"}
  %gemm.5 = f32[2] fusion(%p), calls=%d, metadata={deduplicated_name="gemm.4"}
  ROOT %add.6 = f32[2] add(%p, %p), metadata={op_name="jit(f)/while/body/add"}
  %fusion.7 = f32[2] fusion(%p), calls=%e, metadata={op_name="jit(f)/draft/x" deduplicated_name="fusion.3"}
"""
  st = trace.op_stages(hlo)
  assert st["fusion.3"] == "tree" and st["fusion_7"] == "draft"
  assert st["fusion_3"] == "mixed"  # the kernel name of both fusion.3 and fusion.7
  assert st["gemm.4"] == "verify" and st["gemm.5"] == "?" and st["gemm_4"] == "verify"
  assert st["add.6"] == "loop"


def test_print_memcpys_groups_by_op_per_step(capsys):
  ev = [("MemcpyD2D", 0.75, "loop_dynamic_update_slice_fusion.4"), ("fusion", 3.0, "fusion.1"),
        ("MemcpyD2D", 0.77, "loop_dynamic_update_slice_fusion.4"), ("MemcpyD2H", 1.5, "while.30")]
  trace.print_memcpys(ev, 2)
  out = capsys.readouterr().out.splitlines()
  assert out[1].split() == ["MemcpyD2D", "loop_dynamic_update_slice_fusion.4", "1.0", "0.8"]
  assert out[2].split() == ["MemcpyD2H", "while.30", "0.5", "0.8"]
  trace.print_memcpys(ev[1:2], 1)
  assert capsys.readouterr().out.splitlines()[-1] == "(none)"
