"""Work-list metadata and tile tables: the invariants the kernels rely on."""
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import gmm_kernel, metadata, quant, tuning

TM = 8


@st.composite
def problems(draw):
  # Few distinct static shapes (each compiles once); the sizes themselves vary freely.
  g = draw(st.sampled_from([1, 3, 6]))
  tiles = draw(st.sampled_from([1, 5]))
  rows = draw(st.sampled_from([tiles * TM, tiles * TM - 3]))
  sizes = draw(st.lists(st.integers(0, rows), min_size=g, max_size=g))
  sizes = np.array(sizes, np.int32)
  # Mostly sum <= rows (the contract); sometimes more, which the metadata clamps.
  if draw(st.booleans()):
    sizes = (sizes * rows // max(int(sizes.sum()), 1)).astype(np.int32)
  return sizes, rows, tiles


_make = jax.jit(metadata.make_group_metadata,
                static_argnames=("num_rows", "tm", "num_m_tiles", "for_tgmm"))


@settings(max_examples=40, deadline=None)
@given(problem=problems(), for_tgmm=st.booleans())
def test_work_list_invariants(problem, for_tgmm):
  sizes, rows, tiles = problem
  meta, n = _make(sizes, num_rows=rows, tm=TM, num_m_tiles=tiles, for_tgmm=for_tgmm)
  n = int(n)
  groups, m_tiles, starts, ends = (np.asarray(a)[:n] for a in meta)
  assert n <= tiles + len(sizes) - 1
  # Consecutive visits: out tiles (gmm) / out groups (tgmm) are never revisited after leaving.
  assert np.all(np.diff(m_tiles) >= 0) and np.all(np.diff(groups) >= 0)
  assert np.all((m_tiles >= 0) & (m_tiles < tiles))
  ends_expected = np.minimum(np.cumsum(sizes), rows)
  starts_expected = np.concatenate([[0], ends_expected[:-1]])
  covered = np.zeros(tiles * TM, np.int32)  # how many items compute each row
  for g, t, s, e in zip(groups, m_tiles, starts, ends):
    if e > s:
      assert (s, e) == (starts_expected[g], ends_expected[g])
      lo, hi = max(s, t * TM), min(e, (t + 1) * TM)
      assert lo < hi, "an item must own at least one row of its tile"
      covered[lo:hi] += 1
  total = ends_expected[-1]
  np.testing.assert_array_equal(covered[:total], 1)  # every grouped row exactly once
  np.testing.assert_array_equal(covered[total:], 0)
  nonempty = ends_expected > starts_expected
  if for_tgmm:  # every group visited (empty ones zero their output), nothing past the groups
    np.testing.assert_array_equal(np.unique(groups), np.arange(len(sizes)))
    assert np.all(ends > starts) == np.all(nonempty)
  else:  # every m tile visited, so rows in no group are written (as zeros)
    np.testing.assert_array_equal(np.unique(m_tiles), np.arange(tiles))
    assert set(groups[ends > starts]) == set(np.flatnonzero(nonempty))


@settings(max_examples=40, deadline=None)
@given(problem=problems(), for_tgmm=st.booleans(), slab=st.sampled_from([1, 2, 4, TM]))
def test_boundary_slabs_cover_each_row_once_within_the_cost_estimate(problem, for_tgmm, slab):
  """The rows the kernels multiply (gmm_kernel: a whole tile, or its live slabs at a group
  boundary) hold every grouped row, and number no more than the cost estimate declares."""
  sizes, rows, tiles = problem
  meta, n = _make(sizes, num_rows=rows, tm=TM, num_m_tiles=tiles, for_tgmm=for_tgmm)
  multiplied = 0
  covered = np.zeros(tiles * TM, np.int32)
  for t, s, e in zip(*(np.asarray(a)[:int(n)] for a in meta[1:])):
    if e <= s:
      continue
    if gmm_kernel.covers_tile(s, e, t * TM, TM):
      live = [t * TM]
      slab_rows = TM
    else:
      live = [lo for lo in range(t * TM, (t + 1) * TM, slab)
              if gmm_kernel.slab_is_live(s, e, lo, slab)]
      slab_rows = slab
    multiplied += len(live) * slab_rows
    for lo in live:
      covered[max(lo, s):min(lo + slab_rows, e)] += 1
  total = min(int(sizes.sum()), rows)
  np.testing.assert_array_equal(covered[:total], 1)
  assert multiplied <= gmm_kernel.mxu_rows(total, tiles * TM, slab, len(sizes))


@pytest.mark.parametrize("gen", sorted(tuning.GENERATIONS))
@pytest.mark.parametrize("fmt", sorted(quant.FORMATS))
@pytest.mark.parametrize("kind", ["gmm", "tgmm"])
def test_tiles_are_aligned_and_fit_vmem(gen, fmt, kind):
  g = tuning.GENERATIONS[gen]
  # Kimi-K2.5 per-device expert shapes under EP=8 (c2/perf/bench_gmm.py), and a tiny one.
  for m, k, n in [(32768, 7168, 4096), (32768, 2048, 7168), (40, 72, 24)]:
    tm, tk, tn = tuning.select_tiles(kind, g, m, k, n, 48, fmt, 2)
    assert tm % tuning.ALIGN == 0 and tk % tuning.ALIGN == 0 and tn % tuning.ALIGN == 0
    if kind == "gmm" and tuning.fp4_packed(g, fmt):
      assert tk % (2 * tuning.ALIGN) == 0  # each packed half is lane aligned
    assert tuning.vmem_bytes(kind, (tm, tk, tn), fmt, 2) <= g.vmem_limit_bytes


def test_generation_table():
  assert tuning.get_generation().name == "cpu"  # tests run on the CPU backend
  with tuning.use_target("v5p"):
    assert tuning.get_generation().name == "v5p"
  assert tuning.get_generation("tpu7x").fp4_in_vmem
  # The MXU takes e4m3 as is only on TPU7x (and the interpreter); block formats always dequant.
  e4m3 = quant.FORMATS["fp8"].values_dtype
  assert [tuning.mxu_dtype(tuning.GENERATIONS[g], "fp8") == e4m3
          for g in ("v5e", "v5p", "v6e", "tpu7x")] == [False, False, False, True]
  assert all(tuning.mxu_dtype(g, f).name == "bfloat16"
             for g in tuning.GENERATIONS.values() for f in ("mxfp8", "nvfp4", "bf16"))
  with pytest.raises(ValueError, match="unknown target"):
    tuning.get_generation("v4")
