"""Weight publication: snapshot/delta chains rebuild bit-exactly, checksums catch corruption, deltas
stay small when ~1% of elements change, and the async publisher writes behind the caller's back."""
import os
import random

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from c2.rl import publication
from c2.rl.publication import AsyncPublisher, CorruptWeightsError, WeightStore

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(x):
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}")


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
  return {prefix[:-1]: tree}


def _assert_same(loaded, expected, dtype=BF16):
  """Bit equality after converting the float32 reference to the store dtype."""
  loaded, expected = _flat(loaded), _flat(expected)
  assert sorted(loaded) == sorted(expected)
  for path, want in expected.items():
    want = np.asarray(want)
    if np.issubdtype(want.dtype, np.floating):
      want = want.astype(dtype)
    assert loaded[path].dtype == want.dtype and loaded[path].shape == want.shape, path
    np.testing.assert_array_equal(_bits(loaded[path]), _bits(want), err_msg=path)


def _chain(num_versions=12, frac=0.01, seed=0):
  """Versions of a small pytree: ~`frac` of elements move each step, the bias entirely, the
  integer step counter by one."""
  rng = np.random.default_rng(seed)
  params = {"layer": {"kernel": rng.normal(size=(64, 128)).astype(np.float32),
                      "bias": rng.normal(size=(16,)).astype(np.float32)},
            "embed": rng.normal(size=(256, 32)).astype(np.float32),
            "step": np.array([0, 7], np.int32)}
  chain = [params]
  for _ in range(num_versions - 1):
    new = {"layer": {"kernel": params["layer"]["kernel"].copy(),
                     "bias": rng.normal(size=(16,)).astype(np.float32)},
           "embed": params["embed"].copy(), "step": params["step"] + np.array([1, 0], np.int32)}
    for leaf in (new["layer"]["kernel"], new["embed"]):
      flat = leaf.reshape(-1)
      index = rng.choice(flat.size, size=int(frac * flat.size), replace=False)
      flat[index] += 0.5  # large enough to move the bf16 value
    chain.append(new)
    params = new
  return chain


def _publish_all(store, chain, first=1):
  return [store.publish(first + i, p) for i, p in enumerate(chain)]


def test_chain_rebuilds_bit_exactly_in_any_order(tmp_path):
  chain = _chain()
  records = _publish_all(WeightStore(tmp_path, snapshot_every=5), chain)
  assert [r.kind for r in records] == ["snapshot"] + ["delta"] * 4 + ["snapshot"] + ["delta"] * 4 \
      + ["snapshot"] + ["delta"]
  assert all(r.base == (None if r.kind == "snapshot" else r.version - 1) for r in records)
  reopened = WeightStore(tmp_path)  # a fresh process: manifest only, nothing cached
  assert reopened.versions() == list(range(1, 13)) and reopened.latest_version() == 12
  assert reopened.snapshot_every == 5 and reopened.dtype_name == "bfloat16"
  for version, params in enumerate(chain, start=1):
    _assert_same(reopened.load(version), params)
  order = list(range(1, 13))
  random.Random(0).shuffle(order)
  fresh = WeightStore(tmp_path)
  for version in order:
    _assert_same(fresh.load(version), chain[version - 1])


def test_reopened_store_continues_the_chain(tmp_path):
  chain = _chain(num_versions=6)
  _publish_all(WeightStore(tmp_path, snapshot_every=4), chain[:3])
  store = WeightStore(tmp_path)
  records = _publish_all(store, chain[3:], first=4)
  assert [r.kind for r in records] == ["delta", "snapshot", "delta"]  # counts 3, 4, 5
  for version, params in enumerate(chain, start=1):
    _assert_same(WeightStore(tmp_path).load(version), params)


def test_corrupted_delta_names_the_file(tmp_path):
  chain = _chain(num_versions=4)
  records = _publish_all(WeightStore(tmp_path), chain)
  delta = records[2]
  assert delta.kind == "delta"
  path = os.path.join(tmp_path, delta.file)
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0xFF
  with open(path, "wb") as f:
    f.write(data)
  store = WeightStore(tmp_path)
  _assert_same(store.load(2), chain[1])
  with pytest.raises(CorruptWeightsError, match=rf"{delta.file}.*version {delta.version}"):
    store.load(4)


def test_versions_must_increase(tmp_path):
  store = WeightStore(tmp_path)
  params = _chain(num_versions=1)[0]
  store.publish(3, params)
  for bad in (3, 2):
    with pytest.raises(ValueError, match="must be greater than the last published version 3"):
      store.publish(bad, params)
  with pytest.raises(ValueError, match="must be greater"):
    WeightStore(tmp_path).publish(1, params)
  with pytest.raises(KeyError):
    store.load(4)


def test_deltas_are_small_and_stats_report_identical_fraction(tmp_path):
  store = WeightStore(tmp_path, snapshot_every=100)
  _publish_all(store, _chain())
  stats = store.delta_stats()
  assert stats["num_snapshots"] == 1 and stats["num_deltas"] == 11
  assert stats["delta_to_snapshot_ratio"] < 0.1, stats
  # 1% of the two big leaves, all 16 bias elements, one int: ~0.99 identical.
  assert stats["identical_fraction_mean"] == pytest.approx(0.99, abs=0.003), stats


def test_values_equal_in_bf16_count_as_unchanged(tmp_path):
  base = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  nudged = base.copy()
  nudged[0] = np.nextafter(np.float32(1.0), np.float32(2.0))  # rounds back to 1.0 in bf16
  nudged[3] = 5.0
  store = WeightStore(tmp_path)
  store.publish(1, {"w": base})
  record = store.publish(2, {"w": nudged})
  assert (record.kind, record.changed, record.total) == ("delta", 1, 4)
  _assert_same(WeightStore(tmp_path).load(2), {"w": nudged})


def test_float32_store_is_exact(tmp_path):
  chain = _chain(num_versions=5)
  store = WeightStore(tmp_path, dtype="float32", snapshot_every=3)
  _publish_all(store, chain)
  with pytest.raises(ValueError, match="float32"):
    WeightStore(tmp_path, dtype="bfloat16")
  reopened = WeightStore(tmp_path)
  for version, params in enumerate(chain, start=1):
    _assert_same(reopened.load(version), params, dtype=np.float32)
  assert reopened.load(5)["layer"]["kernel"].dtype == np.float32


def test_prune_keeps_later_versions(tmp_path):
  chain = _chain(num_versions=10)
  store = WeightStore(tmp_path, snapshot_every=4)  # snapshots at 1, 5, 9
  records = _publish_all(store, chain)
  removed = store.prune(7)  # 7 needs 5 (snapshot) and 6
  assert removed == [r.file for r in records[:4]]
  assert not any(os.path.exists(os.path.join(tmp_path, f)) for f in removed)
  reopened = WeightStore(tmp_path)
  assert reopened.versions() == list(range(5, 11))
  for version in range(5, 11):
    _assert_same(reopened.load(version), chain[version - 1])
  with pytest.raises(KeyError):
    reopened.load(3)
  store.prune(100)  # past the end: the latest stays loadable (the next delta's base)
  assert WeightStore(tmp_path).versions() == [9, 10]


def test_async_publisher_writes_jax_arrays(tmp_path):
  chain = _chain(num_versions=3)
  store = WeightStore(tmp_path)
  publisher = AsyncPublisher(store)
  for version, params in enumerate(chain, start=1):
    device_params = {"layer": {k: jnp.asarray(v) for k, v in params["layer"].items()},
                     "embed": jnp.asarray(params["embed"]), "step": jnp.asarray(params["step"])}
    publisher.publish(version, device_params)
    for leaf in (device_params["layer"]["kernel"], device_params["embed"]):
      leaf.delete()  # what donation does: the publisher must already hold its own copy
  publisher.wait()
  assert publisher.latest_published == 3
  with pytest.raises(ValueError, match="must be greater"):
    publisher.publish(2, chain[0])
  publisher.close()
  reopened = WeightStore(tmp_path)
  assert [r.kind for r in reopened.records()] == ["snapshot", "delta", "delta"]
  for version, params in enumerate(chain, start=1):
    _assert_same(reopened.load(version), params)


def test_async_publisher_reraises_writer_errors(tmp_path, monkeypatch):
  chain = _chain(num_versions=3)
  publisher = AsyncPublisher(WeightStore(tmp_path))
  publisher.publish(1, chain[0])
  publisher.wait()

  def failing_write(path, data):
    raise OSError(f"disk full writing {path}")

  monkeypatch.setattr(publication, "write_atomic", failing_write)
  publisher.publish(2, chain[1])
  with pytest.raises(RuntimeError, match="weight publication") as info:
    publisher.wait()
  assert isinstance(info.value.__cause__, OSError)
  monkeypatch.undo()
  publisher.publish(3, chain[2])  # the error was reported once; publishing goes on
  publisher.close()
  assert publisher.latest_published == 3
  _assert_same(WeightStore(tmp_path).load(3), chain[2])


def test_truncate_after_forgets_later_versions_and_they_can_be_published_again(tmp_path):
  """A resumed learner restarts at its checkpoint's step: the versions published after it are
  forgotten (files deleted) and published again, with other weights, from that base."""
  chain = _chain(num_versions=6)
  _publish_all(WeightStore(tmp_path, snapshot_every=4), chain)  # versions 1..6
  store = WeightStore(tmp_path)
  deleted = store.truncate_after(3)
  assert store.versions() == [1, 2, 3] and len(deleted) == 3
  assert not any(os.path.exists(os.path.join(tmp_path, name)) for name in deleted)
  replacement = _chain(num_versions=2, seed=7)[1]
  store.publish(4, replacement)
  reopened = WeightStore(tmp_path)
  _assert_same(reopened.load(3), chain[2])
  _assert_same(reopened.load(4), replacement)
  assert store.truncate_after(9) == []
