"""OpenAI-compatible HTTP server over the engine: /v1/models, /v1/chat/completions, /v1/completions.

  httpd = make_server(cfg, params, tokenizer, host="127.0.0.1", port=8000, slots=8)
  httpd.serve_forever()          # c2/serve.py is the command line

Threads: the engine is not thread-safe, so one `EngineWorker` thread owns it and loops
submit -> step -> dispatch. HTTP handler threads (the standard library's ThreadingHTTPServer, one
per connection) hand it requests through a queue and wait on a per-request queue of TokenEvents,
so a slow client never stalls the batch. Every failure of one request (bad JSON, a prompt longer
than a slot, an exception in a handler) becomes a JSON error for that request only.

Known gap: the engine has no cancel, so a request whose client disconnects keeps its slot until
it finishes (max_tokens or a stop).
"""
from __future__ import annotations

import http.server
import json
import logging
import queue
import threading
import time
import traceback
from typing import Optional

from c2.data.tokenizer import Tokenizer
from c2.infer import openai_api
from c2.infer.engine import Engine, Request, Result, TokenEvent
from c2.infer.sampling import SamplingParams
from c2.model.config import ModelConfig

MAX_BODY_BYTES = 64 << 20
log = logging.getLogger(__name__)


def _error_event(request_id: str, message: str) -> TokenEvent:
  return TokenEvent(request_id, [], [], [], Result(request_id, [], [], [], [], None, "error",
                                                   error=message))


class EngineWorker:
  """Owns the engine on one daemon thread; `submit` may be called from any thread."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._inbox: queue.Queue = queue.Queue()
    self._outboxes: dict[str, queue.Queue] = {}
    self._stopped = threading.Event()
    self._closing = threading.Lock()  # orders submit against close: see _run's end
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._thread.start()

  def submit(self, request: Request) -> queue.Queue:
    """Returns the queue this request's TokenEvents arrive on (the last one has `.result`; an
    error result once the worker is closed)."""
    outbox: queue.Queue = queue.Queue()
    with self._closing:
      if self._stopped.is_set():
        outbox.put(_error_event(request.id, "the engine worker is closed"))
      else:
        self._inbox.put((request, outbox))
    return outbox

  def close(self) -> None:
    with self._closing:
      self._stopped.set()
    self._thread.join(timeout=30)

  def _take_inbox(self) -> None:
    # Idle: block briefly for work rather than spin; busy: take what is there and step.
    block = not self.engine.has_work
    while True:
      try:
        request, outbox = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
      except queue.Empty:
        return
      block = False
      self._outboxes[request.id] = outbox
      self.engine.submit(request)

  def _run(self) -> None:
    while not self._stopped.is_set():
      self._take_inbox()
      if not self.engine.has_work:
        continue
      try:
        events = self.engine.step()
      except Exception as e:  # pylint: disable=broad-except
        # A failed step leaves no trustworthy state for the requests in it: fail them all, keep
        # serving new ones.
        log.exception("engine step failed")
        self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
        continue
      for event in events:
        outbox = self._outboxes.get(event.request_id)
        if outbox is not None:
          outbox.put(event)
        if event.result is not None:
          self._outboxes.pop(event.request_id, None)
    # Closed. Nothing will serve what is queued or in flight: end each with an error result, or
    # its caller waits forever (a rollout thread blocked so kept a test process from exiting).
    # Requests submitted from now on are refused by submit (it checks `_stopped` under the lock
    # close sets it under), so the inbox is complete here.
    while not self._inbox.empty():
      request, outbox = self._inbox.get_nowait()
      self._outboxes[request.id] = outbox
    self._fail_all("the engine worker was closed")

  def _fail_all(self, message: str) -> None:
    engine = self.engine
    for request_id, outbox in list(self._outboxes.items()):
      outbox.put(_error_event(request_id, message))
    self._outboxes.clear()
    # Drop what the engine still holds for them (its queue and slots); private, but the
    # alternative is slots that never free.
    engine._queue.clear()  # pylint: disable=protected-access
    engine._active = [None] * engine.slots  # pylint: disable=protected-access


class Api:
  """What the handlers need: the worker, the tokenizer and the served model's name."""

  def __init__(self, worker: EngineWorker, tokenizer: Tokenizer, model_name: str, capacity: int):
    self.worker, self.tokenizer = worker, tokenizer
    self.model_name, self.capacity = model_name, capacity
    self.created = int(time.time())


class Handler(http.server.BaseHTTPRequestHandler):
  """One HTTP/1.1 connection; JSON bodies, SSE with chunked transfer encoding for streams."""

  protocol_version = "HTTP/1.1"
  server: "Server"

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    log.info("%s %s", self.address_string(), format % args)

  # ------------------------------------------------------------------------------------ routes
  def do_GET(self):  # pylint: disable=invalid-name
    self._guarded(self._get)

  def do_POST(self):  # pylint: disable=invalid-name
    self._guarded(self._post)

  def _get(self):
    if self.path.rstrip("/") in ("/v1/models", "/models"):
      api = self.server.api
      self._json(200, {"object": "list", "data": [
          {"id": api.model_name, "object": "model", "created": api.created, "owned_by": "c2"}]})
    elif self.path.rstrip("/") in ("/health", "/v1/health"):
      self._json(200, {"status": "ok"})
    else:
      raise openai_api.ApiError(f"no route GET {self.path}", 404, "not_found_error")

  def _post(self):
    body = self._read_json()
    api = self.server.api
    route = self.path.split("?")[0].rstrip("/")
    if route in ("/v1/chat/completions", "/chat/completions"):
      prepared = openai_api.prepare_chat(body, api.tokenizer, api.capacity)
    elif route in ("/v1/completions", "/completions"):
      prepared = openai_api.prepare_completion(body, api.tokenizer, api.capacity)
    else:
      raise openai_api.ApiError(f"no route POST {self.path}", 404, "not_found_error")
    self._serve(prepared)

  # --------------------------------------------------------------------------------- internals
  def _guarded(self, route) -> None:
    try:
      route()
    except openai_api.ApiError as e:
      self._json(e.status, e.body())
    except (BrokenPipeError, ConnectionResetError):
      self.close_connection = True
    except Exception as e:  # pylint: disable=broad-except
      log.error("handler failed: %s", traceback.format_exc())
      self._json(500, openai_api.ApiError(f"internal error: {type(e).__name__}: {e}", 500,
                                          "server_error").body())

  def _read_json(self) -> dict:
    try:
      length = int(self.headers.get("Content-Length") or 0)
    except ValueError:
      length = -1
    if not 0 < length <= MAX_BODY_BYTES:
      self.close_connection = True  # the body's extent is unknown: do not reuse the connection
      raise openai_api.ApiError(f"a JSON body of 1..{MAX_BODY_BYTES} bytes (Content-Length) is "
                                "required")
    raw = self.rfile.read(length)
    try:
      body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise openai_api.ApiError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
      raise openai_api.ApiError("the body must be a JSON object")
    return body

  def _json(self, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _serve(self, prepared: openai_api.Prepared) -> None:
    api = self.server.api
    reply = openai_api.Reply(prepared, api.tokenizer, api.model_name)
    outbox = api.worker.submit(prepared.request)
    # The first event decides the status: an engine rejection (e.g. the prompt is too long)
    # must still be a 4xx, so nothing is sent before it arrives.
    event = outbox.get()
    if event.result is not None and event.result.finish_reason == "error":
      raise openai_api.ApiError(event.result.error or "the engine rejected the request")
    if not prepared.stream:
      while True:
        reply.add(event.token_ids, event.logprobs)
        if event.result is not None:
          return self._json(200, reply.response(event.result))
        event = outbox.get()
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()
    for chunk in reply.first_chunks():
      self._sse(chunk)
    while True:
      reply.add(event.token_ids, event.logprobs)
      result = event.result
      if result is not None and result.finish_reason == "error":  # failed mid-stream
        self._sse(openai_api.ApiError(result.error or "engine error", 500, "server_error").body())
        break
      for chunk in reply.chunks(result):
        self._sse(chunk)
      if result is not None:
        break
      event = outbox.get()
    self._write_chunk(b"data: [DONE]\n\n")
    self._write_chunk(b"")

  def _sse(self, payload: dict) -> None:
    self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

  def _write_chunk(self, data: bytes) -> None:
    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    self.wfile.flush()


class Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  api: Api

  def server_close(self) -> None:
    super().server_close()
    self.api.worker.close()


def make_server(cfg: ModelConfig, params, tokenizer: Tokenizer, *, host: str = "127.0.0.1",
                port: int = 8000, slots: int = 8, capacity: int = 4096, prefill_chunk: int = 128,
                draft_depth: int = 0, decode_steps: int = 4, model_name: str = "c2",
                warmup: bool = True) -> Server:
  """Builds the engine (compiling it first when `warmup`, so the first request is not slow)
  and a server bound to (host, port); port 0 picks a free one (`server.server_address`)."""
  engine = Engine(cfg, params, slots=slots, capacity=capacity, prefill_chunk=prefill_chunk,
                  draft_depth=draft_depth, decode_steps=decode_steps,
                  detokenize=tokenizer.decode)
  if warmup:
    started = time.time()
    engine.generate([Request([tokenizer.bos_id], SamplingParams(max_new_tokens=2))])
    log.info("engine compiled in %.1fs", time.time() - started)
  server = Server((host, port), Handler)
  server.api = Api(EngineWorker(engine), tokenizer, model_name, capacity)
  return server


def serve(server: Server, ready_message: Optional[str] = None) -> None:
  """Serves until interrupted (Ctrl-C or SIGTERM), then shuts the engine thread down."""
  if ready_message:
    print(ready_message, flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
