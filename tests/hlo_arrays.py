"""The arrays a compiled program holds, read from its HLO text (test fixtures)."""
import re

import numpy as np


def largest_arrays(hlo: str) -> list[tuple[int, str]]:
  """(elements, shape) of the program's float32 and bool arrays, largest first."""
  found = {(int(np.prod([int(d) for d in dims.split(",") if d])), f"{kind}[{dims}]")
           for kind, dims in re.findall(r"(f32|pred)\[([\d,]*)\]", hlo)}
  return sorted(found, reverse=True)
