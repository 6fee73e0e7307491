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
import queue
import re
import select
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import attrs
import structlog

from draftflow.core.errors import DraftflowError
from draftflow.core.listen import backlog, listen_error, listen_family
from draftflow.core.openai_api import Api, ApiError, Choice, chunk, now, response
from draftflow.core.serving import Engine, QueueFull, ServeRequest

log = structlog.get_logger("draftflow")
POLL_S = 0.1  # how often a waiting handler checks whether its client is still there
DRAIN_LIMIT = 64 << 20  # an oversize body up to this size is read and dropped so the client sees the 413
RETRY_AFTER_S = 1  # a 503 (waiting line full, shutting down) asks the client to retry after this many seconds
IDLE_TIMEOUT_S = 60.0  # a connection that sends nothing (idle keep-alive, half a request) for this long is closed


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
    max_n: int = 8
    prefill_budget: int = 512


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; streamed bodies use chunked transfer encoding
    server: DraftflowServer  # set by socketserver
    timeout = IDLE_TIMEOUT_S  # socket timeout: a stalled client frees its thread instead of holding it forever
    default_request_version = "HTTP/1.0"  # so an error for a garbled request line still has a status line
    responded = False  # a status line went out for the current request (a late failure cannot send a 500 then)
    check_client_at = 0.0  # monotonic time of the next _client_gone check while waiting for events

    def log_message(self, format, *args):
        log.info("http", client=self.client_address[0], line=format % args)

    def handle_one_request(self):
        """One request; a client that vanishes mid-request is logged at info and costs nothing but its thread."""
        self.responded = False
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError) as exc:  # reset, broken pipe, or silent past IDLE_TIMEOUT_S
            log.info("client_gone", client=self.client_address[0], error=f"{type(exc).__name__}: {exc}")
            self.close_connection = True

    def send_response(self, code, message=None):
        self.responded = True
        super().send_response(code, message)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own errors (bad request line, headers too large, unknown method) as JSON."""
        self.close_connection = True
        self._send_error(ApiError(code, message or self.responses.get(code, ("error",))[0]))

    # --- plumbing -----------------------------------------------------------------------
    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._send_body(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        self.server.engine.metrics.http_error(err.status)
        headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": str(RETRY_AFTER_S)}}.get(err.status)
        self._send_json(err.status, err.body(), headers)

    def _fail(self, exc: Exception, request_id: str | None = None) -> None:
        """A bug while handling a request: log it with its traceback, answer 500 if nothing was sent yet."""
        log.error("request_failed", status=500, method=self.command, path=self.path, request_id=request_id,
                  error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        self.close_connection = True
        if not self.responded:
            self._send_error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error"))

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

    def _content_length(self) -> int | None:
        length = self.headers.get("Content-Length")
        return int(length) if length is not None and re.fullmatch(r"[0-9]+", length.strip()) else None

    def _discard_body(self) -> None:
        """Read and drop the body of a refused request (up to DRAIN_LIMIT) so the client gets the answer, not a
        reset for unread data; then close."""
        self.close_connection = True
        length = self._content_length() or 0
        while 0 < length <= DRAIN_LIMIT:
            got = self.rfile.read(min(length, 1 << 16))
            length = length - len(got) if got else 0

    def _read_json(self) -> dict:
        length = self._content_length()
        if length is None:
            self.close_connection = True
            raise ApiError(411 if "Content-Length" not in self.headers else 400,
                           "send the JSON body with a Content-Length header (a decimal byte count)")
        limit = self.server.config.max_body_bytes
        if length > limit:
            self._discard_body()
            raise ApiError(413, f"the request body has {length} bytes; the limit is {limit} "
                                "(draftflow serve --max-body-bytes)", code="request_too_large")
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client closed its side early; the answer is for a client still reading
            self.close_connection = True
            raise ApiError(400, f"the request body ended after {len(raw)} of its {length} bytes (Content-Length)",
                           code="invalid_json")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None
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
                self._send_body(200, data, "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/v1/models":
                self._authorize()
                self._send_json(200, self.server.api.models())
            else:
                self._no_route(path)
        except ApiError as err:
            self._send_error(err)
        except (ConnectionError, TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and is logged; the server keeps serving
            self._fail(exc)

    do_HEAD = do_GET  # same status and headers, no body (_send_body)

    def _no_route(self, path: str) -> None:
        """404 for an unknown path, 405 for a known path asked with the wrong method."""
        self._discard_body()
        takes = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/health": "GET, HEAD",
                 "/metrics": "GET, HEAD", "/v1/models": "GET, HEAD"}.get(path)
        if takes:
            raise ApiError(405, f"{path} takes {takes}, not {self.command}", code="method_not_allowed")
        raise ApiError(404, f"no route {path}; see docs/SERVING.md for the endpoints", code="not_found")

    def _other_method(self):
        try:
            self._no_route(self.path.split("?", 1)[0])
        except ApiError as err:
            self._send_error(err)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
        req = None
        try:
            if kind is None:
                self._no_route(path)
            body = self._read_json()  # first, so no unread body is left on a kept-alive connection
            client = self._authorize()
            parsed = self.server.api.parse(kind, body)
            if parsed.user:  # a gateway holding one key can still get fairness per end user
                client += "/" + parsed.user
            req = ServeRequest(ServeRequest.new_id("chatcmpl" if kind == "chat" else "cmpl"), parsed.prompt_ids,
                               parsed.sampling, parsed.stop, client, n=parsed.n, best_of=parsed.best_of,
                               logprobs=parsed.logprobs is not None)
            try:
                self.server.engine.submit(req)
            except QueueFull as exc:
                raise ApiError(503, str(exc), code="queue_full", type_="server_error") from None
            self._stream(parsed, req) if parsed.stream else self._respond(parsed, req)
        except ApiError as err:
            self._send_error(err)
        except DraftflowError as exc:  # e.g. RequestError from SamplingParams: the request is wrong, not the server
            self._send_error(ApiError(400, str(exc)))
        except (ConnectionError, TimeoutError):  # the client left: its request must not run on
            if req is not None:
                self.server.engine.cancel(req)
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and is logged; the server keeps serving
            if req is not None:
                self.server.engine.cancel(req)
            self._fail(exc, req.id if req is not None else None)

    def _next_event(self, req: ServeRequest):
        """The next event of ``req``, or None once the client has gone (the request is then cancelled).

        The socket is checked every POLL_S even while events keep coming: a non-streamed request
        writes nothing until it ends, so a departed client is only noticed here.
        """
        while True:
            if time.monotonic() >= self.check_client_at:
                self.check_client_at = time.monotonic() + POLL_S
                if self._client_gone():
                    self.server.engine.cancel(req)
                    self.close_connection = True
                    return None
            try:
                return req.events.get(timeout=POLL_S)
            except queue.Empty:
                pass

    def _respond(self, parsed, req: ServeRequest) -> None:
        choices: dict[int, Choice] = {}
        while (event := self._next_event(req)) is not None:
            if event[0] == "error":
                return self._send_error(_event_error(event, parsed))
            c = choices.setdefault(event[1], Choice(event[1], pieces=[] if parsed.logprobs is not None else None))
            if event[0] == "delta":
                c.text += event[2]
                if c.pieces is not None:
                    c.pieces.extend(event[3] or ())
                continue
            c.finish, info = event[2], event[3]
            if info is not None:  # the last choice
                ordered = [choices[i] for i in sorted(choices)]  # the choices ran side by side: ends in any order
                return self._send_json(200, response(parsed, req.id, now(), ordered, info),
                                       {"X-Request-Id": req.id})

    def _stream(self, parsed, req: ServeRequest) -> None:
        created, started, begun = now(), False, set()
        while (event := self._next_event(req)) is not None:
            if event[0] == "error":
                if not started:  # the executor refused it before the first cycle: a plain JSON error
                    return self._send_error(_event_error(event, parsed))
                self._sse(_event_error(event, parsed).body())
                return self._end_stream()
            if not started:
                started = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("X-Request-Id", req.id)
                self.end_headers()
            index = event[1]
            if parsed.kind == "chat" and index not in begun:
                self._sse(chunk(parsed, req.id, created, index, role=True))
            begun.add(index)
            if event[0] == "delta":
                self._sse(chunk(parsed, req.id, created, index, text=event[2], pieces=event[3]))
                continue
            _, _, finish, info = event
            self._sse(chunk(parsed, req.id, created, index, finish=finish, info=info))
            if info is None:
                continue
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


def _event_error(event, parsed) -> ApiError:
    """The ApiError of a worker ``("error", status, message)`` event; a grammar the engine refused names its field."""
    _, status, message = event
    param = parsed.grammar_param if status == 400 and parsed.grammar_param and "grammar" in message.lower() else None
    return ApiError(status, message, param=param, type_="server_error" if status >= 500 else "invalid_request_error")


class DraftflowServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_port = False  # two servers on one port would split its clients silently

    def __init__(self, config: ServeConfig, engine: Engine):
        self.config, self.engine = config, engine
        names = config.model_names or (engine.executor.plan.spec.name,)
        self.api = Api(engine, tuple(names), config.max_tokens_limit, config.default_max_tokens, config.spec_stats,
                       config.max_n)
        self.request_queue_size = backlog(config.max_waiting)  # read by server_activate's listen()
        self.address_family = listen_family(config.host, config.port)
        super().__init__((config.host, config.port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if self.address_family == socket.AF_INET6 else f"http://{host}:{port}"

    def handle_error(self, request, client_address):
        """Whatever escaped a handler: a departed client at info, anything else logged with its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("client_gone", client=client_address[0], error=f"{type(exc).__name__}: {exc}")
        else:
            log.error("connection_failed", client=client_address[0], error=f"{type(exc).__name__}: {exc}", exc_info=exc)


def serve(session, config: ServeConfig, ready=None, engine: Engine | None = None) -> None:
    """Run the server until interrupted; ``ready(server)`` is called once it is listening. ``engine``: one already
    running on ``session`` (``Engine.open_in_worker``, as `draftflow serve` opens it); default: a new one."""
    if engine is None:
        engine = Engine(session, max_waiting=config.max_waiting, prefill_budget=config.prefill_budget)
    try:
        server = DraftflowServer(config, engine)
    except OSError as exc:
        engine.close()
        raise DraftflowError(listen_error(config.host, config.port, exc)) from None
    except DraftflowError:
        engine.close()
        raise
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
