"""`draftflow serve`: an OpenAI-compatible HTTP server on the standard library.

``ThreadingHTTPServer`` gives each connection a thread; those threads only parse, queue
and write. The one ``Engine`` worker thread owns the executor (core/serving.py). A
handler waits on its request's event queue, polling the socket so that a client that
goes away cancels its request (dropped from the queue, or stopped after the current
cycle). Endpoints, fields, errors and metrics: docs/SERVING.md.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import select
import signal
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import attrs
import structlog

from draftflow.core.errors import DraftflowError
from draftflow.core.openai_api import Api, ApiError, chunk, now, response
from draftflow.core.serving import Engine, QueueFull, ServeRequest
from draftflow.core.session import Session

log = structlog.get_logger("draftflow")
POLL_S = 0.1  # how often a waiting handler checks whether its client is still there
DRAIN_LIMIT = 64 << 20  # an oversize body up to this size is read and dropped so the client sees the 413


@attrs.frozen
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_waiting: int = 64
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    model_names: tuple[str, ...] = ()
    spec_stats: bool = False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streamed bodies use chunked transfer encoding
    server: DraftflowServer  # set by socketserver

    def log_message(self, format, *args):
        log.info("http", client=self.client_address[0], line=format % args)

    # --- plumbing -----------------------------------------------------------------------
    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self.server.engine.metrics.http_error(err.status)
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        self._send_json(err.status, err.body(), headers)

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _authorize(self) -> str:
        """Check the API key (if the server has any); return the fairness key of this client."""
        keys = self.server.config.api_keys
        if not keys:
            return self.client_address[0]
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.startswith("Bearer ") else ""
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
        return "key:" + given

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411 if length is None else 400, "send the JSON body with a Content-Length header")
        length, limit = int(length), self.server.config.max_body_bytes
        if length > limit:
            while 0 < length <= DRAIN_LIMIT:
                got = self.rfile.read(min(length, 1 << 16))
                length = length - len(got) if got else 0
            self.close_connection = True
            raise ApiError(413, f"the request body has {int(self.headers['Content-Length'])} bytes; the limit is {limit} "
                                "(draftflow serve --max-body-bytes)", code="request_too_large")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    # --- routes -------------------------------------------------------------------------
    def do_GET(self):
        path = self.path.split("?", 1)[0]
        try:
            if path == "/health":
                self._send_json(200, {"status": "ok"})
            elif path == "/metrics":
                data = self.server.engine.metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif path == "/v1/models":
                self._authorize()
                self._send_json(200, self.server.api.models())
            elif path in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(405, f"{path} takes POST", code="method_not_allowed")
            else:
                raise ApiError(404, f"no route {path}; see docs/SERVING.md for the endpoints", code="not_found")
        except ApiError as err:
            self._send_error(err)

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
        try:
            if kind is None:
                self.close_connection = True  # the body stays unread
                if path in ("/health", "/metrics", "/v1/models"):
                    raise ApiError(405, f"{path} takes GET", code="method_not_allowed")
                raise ApiError(404, f"no route {path}; see docs/SERVING.md for the endpoints", code="not_found")
            body = self._read_json()  # first, so no unread body is left on a kept-alive connection
            client = self._authorize()
            parsed = self.server.api.parse(kind, body)
            if parsed.user:  # a gateway holding one key can still get fairness per end user
                client += "/" + parsed.user
            req = ServeRequest(ServeRequest.new_id("chatcmpl" if kind == "chat" else "cmpl"), parsed.prompt_ids,
                               parsed.sampling, parsed.stop, client)
            try:
                self.server.engine.submit(req)
            except QueueFull as exc:
                raise ApiError(503, str(exc), code="queue_full", type_="server_error") from None
        except ApiError as err:
            self._send_error(err)
            return
        try:
            self._stream(parsed, req) if parsed.stream else self._respond(parsed, req)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.server.engine.cancel(req)
            self.close_connection = True

    def _next_event(self, req: ServeRequest):
        """The next event of ``req``, or None once the client has gone (the request is then cancelled)."""
        while True:
            try:
                return req.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    self.server.engine.cancel(req)
                    self.close_connection = True
                    return None

    def _respond(self, parsed, req: ServeRequest) -> None:
        parts = []
        while (event := self._next_event(req)) is not None:
            if event[0] == "delta":
                parts.append(event[1])
            elif event[0] == "error":
                return self._send_error(_event_error(event))
            else:
                _, finish, info = event
                return self._send_json(200, response(parsed, req.id, now(), "".join(parts), finish, info),
                                       {"X-Request-Id": req.id})

    def _stream(self, parsed, req: ServeRequest) -> None:
        created, started = now(), False
        while (event := self._next_event(req)) is not None:
            if event[0] == "error":
                if not started:  # the executor refused it before the first cycle: a plain JSON error
                    return self._send_error(_event_error(event))
                self._sse(_event_error(event).body())
                return self._end_stream()
            if not started:
                started = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("X-Request-Id", req.id)
                self.end_headers()
                if parsed.kind == "chat":
                    self._sse(chunk(parsed, req.id, created, role=True))
            if event[0] == "delta":
                self._sse(chunk(parsed, req.id, created, text=event[1]))
                continue
            _, finish, info = event
            self._sse(chunk(parsed, req.id, created, finish=finish, info=info))
            if parsed.include_usage:
                self._sse(chunk(parsed, req.id, created, info=info))
            return self._end_stream()

    def _sse(self, obj) -> None:
        self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self._sse(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _event_error(event) -> ApiError:
    """The ApiError of a worker ``("error", status, message)`` event."""
    _, status, message = event
    return ApiError(status, message, type_="server_error" if status >= 500 else "invalid_request_error")


class DraftflowServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, config: ServeConfig, engine: Engine):
        self.config, self.engine = config, engine
        names = config.model_names or (engine.executor.plan.spec.name,)
        self.api = Api(engine, tuple(names), config.max_tokens_limit, config.default_max_tokens, config.spec_stats)
        super().__init__((config.host, config.port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve(session, config: ServeConfig, ready=None) -> None:
    """Run the server until interrupted; ``ready(server)`` is called once it is listening."""
    engine = Engine(session, max_waiting=config.max_waiting)
    try:
        server = DraftflowServer(config, engine)
    except OSError as exc:
        engine.close()
        raise DraftflowError(f"cannot listen on {config.host}:{config.port}: {exc.strerror}; choose another --port") from None
    try:
        if ready is not None:
            ready(server)
        else:
            print(f"draftflow serve: listening on {server.url} (model {', '.join(server.api.model_names)})", flush=True)
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        engine.close()
        sys.stdout.flush()


def run_serve(args) -> int:
    """`draftflow serve GRAPH`: check and open the graph, then listen until SIGINT / SIGTERM."""
    for flag in ("max_waiting", "max_body_bytes", "max_tokens_limit", "default_max_tokens"):
        if getattr(args, flag) < (0 if flag == "max_waiting" else 1):
            raise DraftflowError(f"--{flag.replace('_', '-')} is {getattr(args, flag)}; it must be positive")
    keys = tuple(args.api_keys) or tuple(k for k in [os.environ.get("DRAFTFLOW_API_KEY")] if k)
    # Session.open runs the full `check` (every problem at once) before anything is allocated or bound.
    session = Session.open(graph_path=Path(args.graph), overrides=args.overrides, trace=args.trace)
    print(f"draftflow serve: graph '{session.plan.spec.name}' checked: {len(session.plan.order)} nodes, "
          f"num_draft {session.plan.spec.num_draft}, context {session.executor.kv_tokens} tokens", file=sys.stderr)
    config = ServeConfig(host=args.host, port=args.port, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         max_waiting=args.max_waiting, max_tokens_limit=args.max_tokens_limit,
                         default_max_tokens=args.default_max_tokens, model_names=tuple(args.model_names),
                         spec_stats=args.spec_stats)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve(session, config)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0
