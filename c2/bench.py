"""Benchmarks: `python -m c2.bench NAME [args]` runs `c2/perf/bench_NAME.py`'s main(argv).

  python -m c2.bench gmm            # grouped-matmul kernels: errors per format, AOT cost, speed
  python -m c2.bench gmm --help
  python -m c2.bench decode --workdir runs/tiny   # inference engine vs transformers, speculative,
                                                 # continuous batching
  python -m c2.bench moe            # routed-expert paths on this backend (forward + backward)
  python -m c2.bench head           # the loss head over every token vs over weighted tokens only
  python -m c2.bench envs           # coding environments: rollouts/s and tool-call latency at
                                    # 1, 8, 32 concurrent, sandboxed vs unsandboxed

Each benchmark lives in its own c2/perf/bench_<name>.py so adding one never edits another. A
benchmark exits non-zero when a path it measures disagrees with its reference beyond tolerance:
a fast wrong path never reads as a result.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

from c2 import perf


def available() -> list[str]:
  return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(perf.__path__)
                if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
  names = available()
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
    print(__doc__.strip())
    print("available:", ", ".join(names))
    return 0 if not argv or argv[0] in ("-h", "--help") else 2
  module = importlib.import_module(f"c2.perf.bench_{argv[0]}")
  return module.main(argv[1:]) or 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
