"""Performance accounting: analytic and compiled FLOPs, hardware facts, AOT compilation for TPU
topologies, and the benchmarks `python -m c2.bench NAME` runs (bench_<name>.py)."""
