"""c2/hf/sharded.py and the streaming export: sharded import == single-host import bit for bit
(K2.5 layout: INT4 experts, several shards, language_model. prefix, MTP layer) on the 8-device
CPU mesh, HF -> c2 -> HF round trips (bf16 and INT4) with MTP, atomic output, clear errors."""
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from c2 import model
from c2.hf import checkpoint as hf
from c2.hf.sharded import import_sharded
from c2.hf.tensors import CheckpointError, ShardedWriter, TensorStore, dequantize_int4, quantize_int4
from c2.model.config import get_preset
from c2.parallel.mesh import make_mesh


def _on_int4_grid(shape, rng):
  """Our expert leaf [..., I, O] whose HF [O, I] slices are exactly INT4 group-32 values: every
  group holds a 7 (so the symmetric quantiser finds the same bf16 scale)."""
  q = rng.randint(-8, 8, shape).astype(np.float32)
  q[..., ::32, :] = 7
  scale_shape = shape[:-2] + (shape[-2] // 32, 1, shape[-1])
  scale = (rng.rand(*scale_shape) * 0.1 + 0.01).astype(ml_dtypes.bfloat16).astype(np.float32)
  return (q.reshape(scale_shape[:-3] + (shape[-2] // 32, 32, shape[-1])) * scale).reshape(shape)


def _params(cfg, seed=0, grid=False):
  rng = np.random.RandomState(seed)
  def one(path, a):
    key = jax.tree_util.keystr(path)
    if grid and any(f"'moe']['{p}']" in key for p in ("gate", "up", "down")):
      return _on_int4_grid(a.shape, rng)
    return rng.randn(*a.shape).astype(np.float32)
  return jax.tree_util.tree_map_with_path(one, model.abstract_params(cfg))


def _to_k25_layout(src, dst):
  """An exported checkpoint rewritten as the K2.5 release lays it out: `language_model.` prefix,
  the LM config under text_config, a vision tensor, several shards."""
  store, writer = TensorStore(str(src)), ShardedWriter(str(dst), max_shard_bytes=300_000)
  for name in store.names():
    writer.add("language_model." + name, store.read(name))
  writer.add("vision_tower.patch_embed.weight", np.ones((4, 4), ml_dtypes.bfloat16))
  writer.close()
  raw = json.loads((src / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": raw}))


CFG = get_preset("tiny", vocab_size=512, mtp_depth=1, num_layers=3)


@pytest.fixture(scope="module")
def k25_dir(tmp_path_factory):
  """(directory in the K2.5 layout with INT4 experts, the params it holds)."""
  tmp = tmp_path_factory.mktemp("k25")
  params = _params(CFG, grid=True)
  hf.export_checkpoint(CFG, params, str(tmp / "plain"), dtype="float32", quantize_experts=True)
  _to_k25_layout(tmp / "plain", tmp / "k25")
  return tmp / "k25", params


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype, path
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=str(path))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_sharded_import_equals_single_host_bit_for_bit(k25_dir, dtype):
  path, params = k25_dir
  assert len(set(json.loads((path / "model.safetensors.index.json").read_text())[
      "weight_map"].values())) > 3
  mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  cfg, sharded = import_sharded(str(path), mesh, dtype=dtype)
  want_cfg, want = hf.import_checkpoint(str(path), dtype=dtype)
  assert cfg == want_cfg and cfg.mtp_depth == 1
  specs = model.param_shardings(cfg, mesh)
  gate = sharded["moe_layers"]["block"]["moe"]["gate"]
  assert gate.sharding == specs["moe_layers"]["block"]["moe"]["gate"]
  assert not gate.sharding.is_fully_replicated  # really split: experts x embed x expert_mlp
  _same(sharded, want)
  if dtype == np.float32:  # the INT4 grid values came back exactly (dequant(quant(x)) == x)
    _same(want, params)
  stats = import_sharded.stats
  assert 0 < stats["bytes_read"] and stats["bytes_placed"] > 0


def test_round_trips_hf_c2_hf_bf16_and_int4_with_mtp(k25_dir, tmp_path):
  path, params = k25_dir
  mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
  cfg, sharded = import_sharded(str(path), mesh)
  # INT4: the experts re-quantise to the very same packed words and scales.
  hf.export_checkpoint(cfg, sharded, str(tmp_path / "int4"), dtype="float32",
                       quantize_experts=True, max_shard_bytes=200_000)
  before, after = TensorStore(str(path)), TensorStore(str(tmp_path / "int4"))
  names = [n for n in before.names() if n.startswith("language_model.")]
  assert sorted(n[len("language_model."):] for n in names) == sorted(after.names())
  assert any(".layers.3.eh_proj" in n for n in names)  # the MTP layer made the trip
  for name in names:
    np.testing.assert_array_equal(after.read(name[len("language_model."):]), before.read(name),
                                  err_msg=name)
  # bf16: equals the input rounded to bf16, MTP included.
  hf.export_checkpoint(cfg, sharded, str(tmp_path / "bf16"), dtype="bfloat16")
  _, got = hf.import_checkpoint(str(tmp_path / "bf16"), dtype=ml_dtypes.bfloat16)
  want = jax.tree_util.tree_map_with_path(
      lambda p, x: x if "correction_bias" in jax.tree_util.keystr(p)
      else x.astype(ml_dtypes.bfloat16), params)
  _same(got, want)
  assert "mtp_0" in got


def test_int4_quantiser_inverts_dequantiser():
  rng = np.random.RandomState(3)
  w = _on_int4_grid((96, 5), rng).T  # HF [O=5, I=96]
  packed, scale = quantize_int4(w)
  np.testing.assert_array_equal(dequantize_int4(packed, scale, w.shape), w)
  off_grid = rng.randn(5, 96).astype(np.float32)
  packed, scale = quantize_int4(off_grid)
  err = np.abs(dequantize_int4(packed, scale, off_grid.shape) - off_grid)
  assert np.all(err <= np.repeat(scale.astype(np.float32), 32, 1) * 0.51)


def test_half_written_export_is_refused(k25_dir, tmp_path):
  path, _ = k25_dir
  partial = tmp_path / "out.tmp-123"
  partial.mkdir()
  (partial / "shard-00000.tmp").write_bytes(b"\0" * 16)
  (partial / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(CheckpointError, match="half-written"):
    hf.import_checkpoint(str(partial))
  with pytest.raises(CheckpointError, match="half-written"):
    import_sharded(str(partial), make_mesh({"fsdp": 8}))
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(FileExistsError):
    hf.export_checkpoint(CFG, _params(CFG), str(tmp_path / "full"))
  assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n and n != "out.tmp-123"]


def test_mismatch_errors_name_the_tensor(k25_dir, tmp_path):
  path, _ = k25_dir
  mesh = make_mesh({"fsdp": 8})
  raw = json.loads((path / "config.json").read_text())
  bad = tmp_path / "bad"
  bad.mkdir()
  for name in os.listdir(path):
    if name != "config.json":
      os.symlink(path / name, bad / name)
  raw["text_config"]["moe_intermediate_size"] = 64  # weights have 128
  (bad / "config.json").write_text(json.dumps(raw))
  with pytest.raises(CheckpointError, match=r"language_model\.model\.layers\.1\.mlp\.experts\.0"
                     r"\.down_proj: \[out, in\] = \(256, 128\).*moe_intermediate_size"):
    import_sharded(str(bad), mesh)
  # The offline conversion raises the same error from its writer thread and leaves no output.
  from c2.hf import convert  # pylint: disable=import-outside-toplevel
  with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj: \[out, in\] = \(256, 128\)"
                                            r".*our parameter .*moe_intermediate_size"):
    convert.import_hf(str(bad), str(tmp_path / "c2"), "bfloat16", 1, 0.015625)
  assert not [p for p in os.listdir(tmp_path) if p.startswith("c2")]  # nor a temporary
  raw["text_config"]["moe_intermediate_size"] = 128
  raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"][
      "group_size"] = 64
  (bad / "config.json").write_text(json.dumps(raw))
  with pytest.raises(CheckpointError, match=r"experts\.0\.\w+_proj\.weight_scale: shape .* groups "
                                            r"of 64"):
    import_sharded(str(bad), mesh)


def test_init_from_accepts_hf_and_converted_directories(k25_dir, tmp_path):
  from c2.hf import convert  # pylint: disable=import-outside-toplevel
  from c2.parallel.sharding import with_shardings  # pylint: disable=import-outside-toplevel
  from c2.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  path, _ = k25_dir
  mesh = make_mesh({"fsdp": 4, "tensor": 2})
  _, want = hf.import_checkpoint(str(path))
  cfg = CFG.replace(mtp_depth=2, param_dtype="float32")  # the model has one MTP layer more
  abstract = with_shardings(model.abstract_params(cfg), model.param_shardings(cfg, mesh))
  # Slices of 16 KB: the larger leaves are written in several (c2/hf/orbax_stream.py).
  convert.main(["import", str(path), str(tmp_path / "c2"), "--slice-mb", "0.015625"])
  stats = convert.import_hf.stats
  assert stats["largest_slice"] <= 16 << 10 and stats["largest_leaf"] >= 8 * stats["largest_slice"]
  for source in ("hf:" + str(path), str(path), str(tmp_path / "c2")):
    restored, missing = ckpt_lib.restore_params_subset(source, abstract)
    assert missing == ["mtp_1"], source
    _same(restored, {k: v for k, v in want.items()})
    leaf = restored["moe_layers"]["block"]["moe"]["up"]
    assert leaf.sharding.is_equivalent_to(abstract["moe_layers"]["block"]["moe"]["up"].sharding,
                                          leaf.ndim), source


def test_sharded_export_loads_in_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  from tests.hf import test_hf  # pylint: disable=import-outside-toplevel
  m = test_hf._torch_model("k25_yarn_grouped")  # pylint: disable=protected-access
  m.save_pretrained(tmp_path / "src", safe_serialization=True)
  cfg, params = import_sharded(str(tmp_path / "src"), make_mesh({"fsdp": 2, "expert": 4}))
  hf.export_checkpoint(cfg, params, str(tmp_path / "out"), dtype="float32",
                       max_shard_bytes=200_000)
  reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
      str(tmp_path / "out"), attn_implementation="eager", dtype="float32").eval()
  tokens = test_hf._tokens(seed=7)  # pylint: disable=protected-access
  ours = np.asarray(jax.jit(lambda p, t: model.logits(cfg.replace(remat_policy="none"), p, t))(
      params, tokens))
  theirs = test_hf._torch_logits(reloaded, tokens)  # pylint: disable=protected-access
  original = test_hf._torch_logits(m, tokens)  # pylint: disable=protected-access
  print(f"sharded export -> transformers: |ours - transformers| = "
        f"{np.abs(ours - theirs).max():.2e}, |reloaded - original| = "
        f"{np.abs(theirs - original).max():.2e}")
  assert np.abs(theirs - original).max() <= 1e-6
  assert np.abs(ours - theirs).max() <= test_hf.TOL


def test_int4_export_loads_in_transformers(tmp_path):
  """The INT4 export (the release's compressed-tensors pack-quantized experts) read by transformers
  through the compressed-tensors library, an independent decoder of the format: its experts
  equal our dequantised ones at the precision it keeps them in (the scales' bf16), and its logits
  equal ours with the experts at that precision."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("compressed_tensors")
  import torch  # pylint: disable=import-outside-toplevel
  from tests.hf import test_hf  # pylint: disable=import-outside-toplevel
  m = test_hf._torch_model("k25_yarn_grouped")  # pylint: disable=protected-access
  m.save_pretrained(tmp_path / "src", safe_serialization=True)
  cfg, params = hf.import_checkpoint(str(tmp_path / "src"), dtype=np.float32)
  hf.export_checkpoint(cfg, params, str(tmp_path / "int4"), dtype="float32",
                       quantize_experts=True)
  _, ours = hf.import_checkpoint(str(tmp_path / "int4"), dtype=np.float32)  # dequantised, f32
  reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
      str(tmp_path / "int4"), attn_implementation="eager", dtype="float32").eval()
  theirs = {k: v.detach().float().numpy() for k, v in reloaded.state_dict().items()}
  # Our layout: moe stack [layers, E, D, F]; transformers' fused [E, 2F, D] (gate rows first).
  moe = ours["moe_layers"]["block"]["moe"]
  to_bf16 = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
  f = moe["gate"].shape[-1]
  for i in range(moe["gate"].shape[0]):
    hf_layer = i + cfg.first_k_dense
    fused = theirs[f"model.layers.{hf_layer}.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(fused[:, :f], to_bf16(moe["gate"][i]).transpose(0, 2, 1))
    np.testing.assert_array_equal(fused[:, f:], to_bf16(moe["up"][i]).transpose(0, 2, 1))
    np.testing.assert_array_equal(theirs[f"model.layers.{hf_layer}.mlp.experts.down_proj"],
                                  to_bf16(moe["down"][i]).transpose(0, 2, 1))
  at_bf16 = {**ours, "moe_layers": jax.tree.map(lambda x: x, ours["moe_layers"])}
  at_bf16["moe_layers"]["block"]["moe"] = {
      **moe, **{k: to_bf16(moe[k]) for k in ("gate", "up", "down")}}
  for weight in reloaded.parameters():  # the bf16 experts' values, computed in float32 like ours
    weight.data = weight.data.float()  # (a quantized model refuses .float())
  tokens = test_hf._tokens(seed=7)  # pylint: disable=protected-access
  logits = lambda p: np.asarray(jax.jit(
      lambda p, t: model.logits(cfg.replace(remat_policy="none"), p, t))(p, tokens))
  with torch.no_grad():
    hf_logits = reloaded(torch.tensor(tokens)).logits.numpy()
  error = np.abs(logits(at_bf16) - hf_logits).max()
  print(f"INT4 export -> transformers: |ours - transformers| = {error:.2e} (experts at bf16), "
        f"{np.abs(logits(ours) - hf_logits).max():.2e} (ours at float32)")
  assert error <= test_hf.TOL


@pytest.mark.slow
def test_two_processes_and_peak_rss_on_a_synthetic_k25_checkpoint(tmp_path):
  """c2/perf/bench_hf_import.py at 0.1 GB (8 experts): one process on 8 devices and two processes on 4 each
  (jax.distributed over localhost) hold exactly the single-host import's blocks, and peak RSS
  stays within resident device bytes + 3x the largest device block + 0.5 GB (runtime)."""
  from c2.perf import bench_hf_import as bench  # pylint: disable=import-outside-toplevel
  ckpt = str(tmp_path / "k25")
  bench.make(ckpt, 0.0625)
  bench.run(ckpt, str(tmp_path / "one.json"), 1, False)
  bench.run(ckpt, str(tmp_path / "two.json"), 2, False, export=str(tmp_path / "exported"))
  bench.run(ckpt, str(tmp_path / "single.json"), 1, True)
  load = lambda name: json.loads((tmp_path / name).read_text())
  single, one, two = load("single.json"), load("one.json"), [load(f"two.json.{i}") for i in (0, 1)]
  assert one["crc"] == single["crc"]
  assert {**two[0]["crc"], **two[1]["crc"]} == single["crc"] and two[0]["crc"] != two[1]["crc"]
  for stats in [one] + two:
    bound = stats["bytes_placed"] + 3 * stats["largest_block"] + (512 << 20)
    print(f"process {stats['process']}: peak RSS {stats['peak_rss'] / 1e9:.2f} GB, bound "
          f"{bound / 1e9:.2f} GB, checkpoint {stats['checkpoint_bytes'] / 1e9:.2f} GB")
    assert stats["peak_rss"] <= bound
  # The two-process streaming export wrote every tensor once, equal to the source in bf16 (INT4
  # experts dequantised; the float32 router rounded by the bf16 import; its bias kept float32).
  source, exported = TensorStore(ckpt), TensorStore(str(tmp_path / "exported"))
  source.int4_group = 32
  # Its memory: the import's peak + the largest tensor twice (gathered, then cast for the file) +
  # replicas of one 8 MB row block on the 4 local devices (float32 on CPU, a few buffers each) +
  # 0.5 GB for XLA's collectives runtime and programs (measured 0.45). Slicing sharded leaves
  # through the partitioner instead gathered whole leaves: 1.77 GB here.
  largest = max(exported.read(name).nbytes for name in exported.names())
  for stats in two:
    bound = stats["peak_rss"] + 2 * largest + 24 * (8 << 20) + (512 << 20)
    print(f"process {stats['process']}: export peak RSS {stats['export_peak_rss'] / 1e9:.2f} GB, "
          f"bound {bound / 1e9:.2f} GB, {stats['export_seconds']:.1f} s")
    assert stats["export_peak_rss"] <= bound
  for name in exported.names():
    if ".layers.6." in name and name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
      continue  # the MTP layer's copies of the shared embedding / head (not in the source)
    src = "language_model." + name
    if src in source:
      want = source.read(src)
    else:
      want = source.linear(src[:-len(".weight")]).astype(ml_dtypes.bfloat16)
    if not name.endswith("e_score_correction_bias"):
      want = want.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(exported.read(name), want.astype(exported.read(name).dtype),
                                  err_msg=name)


def test_linear_select_equals_slicing_the_dequantised_weight(tmp_path):
  """Any row/column selection, aligned to the FP8 128x128 / INT4 group-32 blocks or not, equals
  slicing the whole dequantised weight bit for bit (only the covering blocks are read)."""
  from tests.hf.test_hf import quantize_fp8  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(4)
  writer = ShardedWriter(str(tmp_path))
  q, scale_inv, _ = quantize_fp8(rng.randn(300, 260).astype(np.float32))
  writer.add("fp8.weight", q)
  writer.add("fp8.weight_scale_inv", scale_inv)
  packed, scale = quantize_int4(rng.randn(40, 96).astype(np.float32))
  writer.add("int4.weight_packed", packed)
  writer.add("int4.weight_scale", scale)
  writer.add("int4.weight_shape", np.array([40, 96], np.int32))
  writer.close()
  store = TensorStore(str(tmp_path))
  for module, rows, cols in [("fp8", np.arange(100, 290), np.arange(5, 140)),
                             ("fp8", np.arange(0, 300, 7), np.arange(250, 260)),
                             ("int4", np.arange(3, 17), np.arange(13, 70)),
                             ("int4", np.arange(40), np.arange(0, 96, 5))]:
    want = store.linear(module)[np.ix_(rows, cols)]
    np.testing.assert_array_equal(store.linear_select(module, rows, cols), want)


@pytest.mark.slow
def test_offline_conversion_memory_is_bounded_by_slices_not_leaves(tmp_path):
  """`python -m c2.perf.bench_hf_import run --offline 4`: the 0.5 GB synthetic K2.5 checkpoint
  (64 INT4 experts; its largest leaf, one stacked expert projection, is 5 x 64 x 1024 x 768 =
  503 MB in bf16) converted to Orbax in slices of 4 MB by 2 workers. Peak RSS above the RSS
  before the conversion stays within 3 slices' float32 blocks per worker + one 64 MB read chunk
  per worker + 256 MB for TensorStore's and Orbax's buffers, a fraction of that one leaf (the
  per-leaf conversion this replaced held it whole: 2.6x the largest leaf). The checkpoint,
  restored on the 8-device mesh, equals the single-host import block for block."""
  from c2.perf import bench_hf_import as bench  # pylint: disable=import-outside-toplevel
  ckpt = str(tmp_path / "k25")
  bench.make(ckpt, 0.5)
  bench.run(ckpt, str(tmp_path / "single.json"), 1, True)
  bench.run(ckpt, str(tmp_path / "offline.json"), 1, False, workers=2, offline_slice_mb=4)
  single = json.loads((tmp_path / "single.json").read_text())
  offline = json.loads((tmp_path / "offline.json").read_text())
  assert offline["crc"] == single["crc"]
  transient = offline["peak_rss"] - offline["rss_before"]
  bound = 2 * (3 * offline["largest_slice"] * 2 + (64 << 20)) + (256 << 20)
  print(f"offline conversion: +{transient / 1e6:.0f} MB over {offline['rss_before'] / 1e9:.2f} GB "
        f"(bound {bound / 1e6:.0f} MB; largest leaf {offline['largest_leaf'] / 1e6:.0f} MB, "
        f"slice {offline['largest_slice'] / 1e6:.1f} MB), {offline['seconds']:.1f} s, "
        f"{offline['bytes_read'] / 1e9 / offline['seconds']:.3f} GB/s read")
  assert offline["largest_leaf"] >= 400e6 and transient <= bound < offline["largest_leaf"]
