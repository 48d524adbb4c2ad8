"""The metrics writer: TensorBoard + JSONL on process 0; non-finite values logged by name."""
import json
import logging
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from c2.train.metrics import MetricWriter


def test_non_finite_metrics_are_written_and_named(tmp_path, caplog):
  writer = MetricWriter(str(tmp_path), enabled=True)
  with caplog.at_level(logging.WARNING):
    bad = writer.write_scalars(7, {"train/loss": 2.5, "train/mtp/1/kl": float("nan"),
                                   "train/grad_norm": float("inf")})
  writer.close()
  assert bad == ["train/grad_norm", "train/mtp/1/kl"]
  assert "step 7: non-finite metrics train/grad_norm=inf, train/mtp/1/kl=nan" in caplog.text
  (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert row == {"step": 7, "train/loss": 2.5, "train/mtp/1/kl": "nan", "train/grad_norm": "inf"}
  events = EventAccumulator(str(tmp_path))
  events.Reload()
  assert math.isnan(events.Scalars("train/mtp/1/kl")[0].value)   # in TensorBoard, as a NaN
  assert math.isinf(events.Scalars("train/grad_norm")[0].value)
  assert events.Scalars("train/loss")[0].value == 2.5


def test_a_writer_on_another_process_writes_nothing(tmp_path):
  writer = MetricWriter(str(tmp_path / "tb"), enabled=False)
  assert writer.write_scalars(1, {"train/loss": float("nan")}) == []
  writer.close()
  assert not (tmp_path / "tb").exists()


def test_images_reach_tensorboard(tmp_path):
  import io

  import numpy as np
  from PIL import Image
  image = np.zeros((6, 10, 3), np.uint8)
  image[:, :5, 0] = 255  # left half red
  writer = MetricWriter(str(tmp_path), enabled=True)
  writer.write_images(60, {"eval/plots/pareto": image})
  writer.close()
  events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
  events.Reload()
  (event,) = events.Images("eval/plots/pareto")
  assert (event.step, event.width, event.height) == (60, 10, 6)
  np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(event.encoded_image_string))),
                                image)
