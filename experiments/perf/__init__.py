"""Performance tooling: step, kernel and GEMM benchmarks, the kernel profiler, offline compiles
(`harness.py` holds what they share, `common_flags.py` their shared flags). `run_h200.sh PART
OUT` groups the H200 runs."""
