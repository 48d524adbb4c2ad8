"""Serve a checkpoint over an OpenAI-compatible HTTP API.

  python -m c2.serve --checkpoint DIR [--dtype float32] [--host 127.0.0.1] [--port 8000] \
      [--slots 8] [--capacity 4096] [--draft-depth 0]

DIR is a c2 training workdir, a converted checkpoint (`python -m c2.hf.convert import`) or a
Hugging Face DeepseekV3/Kimi directory (c2/infer/loading.py). Then, e.g. with the `openai` client:
  OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused").chat.completions.create(
      model="c2", messages=[{"role": "user", "content": "Hi"}])
The line "c2.serve: ready on http://HOST:PORT" is printed once the engine has compiled and the
port is open (scripts and tests wait for it). --capacity is tokens per sequence (prompt +
completion); --slots is how many sequences decode together.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal

from c2.infer import loading
from c2.infer import server as server_lib


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="workdir, converted or HF directory")
  parser.add_argument("--dtype", choices=loading.DTYPES, default=None,
                      help="override the compute dtype (float32 for reference numerics)")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--capacity", type=int, default=4096)
  parser.add_argument("--prefill-chunk", type=int, default=128)
  parser.add_argument("--draft-depth", type=int, default=0, help="MTP speculative tokens")
  parser.add_argument("--decode-steps", type=int, default=4,
                      help="decode steps per device call (tokens stream in groups of this many)")
  parser.add_argument("--model-name", default=None, help="served id (default: DIR's basename)")
  parser.add_argument("--log-level", default="WARNING")
  return parser.parse_args(argv)


def _stop_on_sigterm(signum, frame):
  del signum, frame
  raise KeyboardInterrupt  # serve_forever unwinds and the engine thread is shut down


def main(argv=None) -> None:
  args = parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
  try:
    cfg, params, tokenizer = loading.load_for_serving(args.checkpoint, args.dtype)
  except loading.LoadError as e:
    raise SystemExit(f"c2.serve: {e}") from None
  name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
  server = server_lib.make_server(
      cfg, params, tokenizer, host=args.host, port=args.port, slots=args.slots,
      capacity=args.capacity, prefill_chunk=args.prefill_chunk, draft_depth=args.draft_depth,
      decode_steps=args.decode_steps, model_name=name)
  host, port = server.server_address[:2]
  signal.signal(signal.SIGTERM, _stop_on_sigterm)
  server_lib.serve(server, ready_message=f"c2.serve: ready on http://{host}:{port}")


if __name__ == "__main__":
  main()
