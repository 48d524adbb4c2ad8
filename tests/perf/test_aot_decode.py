"""AOT compilation of the serving decode step for a TPU topology, from this CPU host (libtpu)."""
import pytest

from c2.infer import cache as cache_lib
from c2.perf import aot_decode

pytest.importorskip("libtpu", reason="needs the tpu extra: pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu_aot


def test_parse_mesh():
  assert aot_decode.parse_mesh("expert=32,tensor=4") == {"expert": 32, "tensor": 4}
  assert aot_decode.parse_mesh(None) is None
  with pytest.raises(ValueError, match="axis=size"):
    aot_decode.parse_mesh("expert:4")


def test_serving_config_is_bf16():
  cfg = aot_decode.serving_config("kimi-k2.5")
  assert cfg.param_dtype == "bfloat16" and cfg.dtype == "bfloat16"
  # 576 latent values per layer and token, 2 bytes each, 61 layers.
  assert cache_lib.bytes_per_token(cfg, cfg.dtype) == 61 * 576 * 2


@pytest.mark.slow
def test_proxy_decode_compiles_for_tpu_and_fits():
  """The ~30B proxy's decode step, 8 slots x 4k tokens, on 4 v5p chips with every device on the
  expert axis: compiled for TPU (not this CPU), the cache sharded over slots and donated, and it
  fits. Measured (unrolled layers): 14.4 GiB params + 0.2 GiB cache + 1.0 GiB temporaries of 95;
  ~95 s."""
  cfg = aot_decode.serving_config("proxy-30b")
  report = aot_decode.compile_decode(cfg, "v5p:2x2x1", slots=8, capacity=4096,
                                     mesh_axes={"expert": 4}, preset="proxy-30b")
  print(report.format())
  assert report.platform == "tpu" and report.code_bytes > 0
  assert report.num_devices == 4 and report.mesh == {"expert": 4}
  # The cache is split over the slots (8 / 4 devices) and aliased with its output (donated). Per
  # slot: the trunk stacks, plus the drafter's carry (one pending bf16 hidden row at draft depth 0)
  # and four int32 slot vectors (lengths, mtp_lengths, pending_count, one pending token).
  per_slot = 4096 * report.cache_bytes_per_token + cfg.hidden_size * 2 + 4 * 4
  assert report.cache_bytes == 8 // 4 * per_slot
  assert report.alias_bytes >= report.cache_bytes
  # Every param is an argument (keep_unused), so the arguments hold params and cache.
  assert report.argument_bytes >= report.param_bytes + report.cache_bytes
  assert report.collectives["ragged-all-to-all"] > 0  # the TPU expert dispatch, not CPU's
  assert report.fits and "FITS" in report.format()
