"""The HTTP servers of a process: operations (``MetricsServer``: Prometheus
``/metrics``, ``/healthz`` and ``/readyz``) and, on ``neardup run``, the optional query
endpoint (``QueryServer``).

WSGI applications run by the standard library's ``wsgiref`` server, one thread per
request, in a daemon thread. The operations paths:

- ``/metrics``: the ``Metrics`` registry in the Prometheus text format
  (prometheus_client's WSGI app).
- ``/healthz``: 200 ``ok`` while the process is alive (liveness).
- ``/readyz``: 200 when the ``ready`` check passes, 503 otherwise; the body says why in
  one line (readiness).

They answer GET and HEAD only (405 otherwise). The query endpoint: see ``QueryServer``.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from neardup.errors import ServerError  # raised here; re-exported as neardup.server.ServerError

if TYPE_CHECKING:  # prometheus_client is imported when a server starts, not by every command
    from neardup.core.settings import EngineSettings
    from neardup.kafka.progress import Progress
    from neardup.metrics import Metrics
    from neardup.state.kv import KeyValueStateStore

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], tuple[bool, str]]


class Readiness:
    """Readiness of a Kafka consumer: no state being restored, partitions assigned, the
    broker heard from within ``broker_timeout`` seconds, and not stalled (``progress``:
    input waiting with no batch committed for longer than its ``stall_after``, or a restore
    running, ``neardup.kafka.progress``). Thread-safe;
    ``check`` is the ``/readyz`` test.

    Feed it with ``set_assignment`` (``on_assignment``) and ``broker_answered``
    (``on_broker``); ``progress`` is fed by the consumer's runtime.
    """

    def __init__(self, broker_timeout: float = 30.0, progress: Progress | None = None) -> None:
        self.broker_timeout = broker_timeout
        self.progress = progress
        self._lock = threading.Lock()
        self._partitions = 0
        self._broker_at: float | None = None
        self._restoring = False

    def set_assignment(self, partitions: Sequence[Any]) -> None:
        with self._lock:
            self._partitions = len(partitions)

    def set_restoring(self, restoring: bool) -> None:
        """The state is being restored from its changelog (not ready meanwhile)."""
        with self._lock:
            self._restoring = restoring

    def broker_answered(self) -> None:
        with self._lock:
            self._broker_at = time.monotonic()

    def check(self) -> tuple[bool, str]:
        """(ready, reason): the reason is one line for the ``/readyz`` body."""
        with self._lock:
            partitions, broker_at, restoring = self._partitions, self._broker_at, self._restoring
        if restoring:
            return False, "restoring the state from the changelog"
        checking = self.progress.restoring_for() if self.progress is not None else None
        if checking is not None:  # the runtime's check of partitions newly assigned
            return False, f"restoring the state of {checking[0]} for {checking[1]:.0f} s"
        if broker_at is None:
            return False, "broker not reached yet"
        silent = time.monotonic() - broker_at
        if silent > self.broker_timeout:
            return False, f"broker silent for {silent:.0f} s"
        if partitions == 0:
            return False, "no partitions assigned"
        stalled = self.progress.stalled() if self.progress is not None else None
        if stalled is not None:
            return False, stalled
        return True, f"ready: {partitions} partition(s) assigned"


def always_ready() -> tuple[bool, str]:
    """The readiness of a process with nothing to wait for (the embedded mode)."""
    return True, "ready"


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        log.debug("%s %s", self.address_string(), format % args)


def _text(start_response: Callable[..., Any], status: str, body: str,
          headers: Sequence[tuple[str, str]] = ()) -> Iterable[bytes]:
    data = (body + "\n").encode("utf-8")
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(data))), *headers])
    return [data]


#: The only methods served: the endpoints are read-only.
METHODS = ("GET", "HEAD")


class _Served:
    """What the servers share: ``host``, ``port`` (the one bound after ``start``), the
    base ``url``, ``close``, use as a context manager."""

    host: str
    port: int
    _server: WSGIServer | None = None
    _thread: threading.Thread | None = None

    def _listen(self, app: Callable[..., Iterable[bytes]], what: str) -> None:
        """Serve ``app`` in a daemon thread (``ServerError`` if the address cannot be bound)."""
        self._server, self._thread, self.port = _serve(self.host, self.port, app, what)

    @property
    def url(self) -> str:
        """Base URL of the server, for clients on this host."""
        return _url(self.host, self.port)

    def close(self) -> None:
        """Stop serving and release the port."""
        _stop(self._server, self._thread)
        self._server = self._thread = None

    def __enter__(self) -> _Served:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> _Served:
        raise NotImplementedError


class MetricsServer(_Served):
    """Serves ``metrics`` and the health checks on ``host:port`` (port 0: any free port).

    Use ``start()`` then ``close()``, or as a context manager.

    Args:
        metrics: the registry to expose.
        host: address to listen on (``0.0.0.0``, ``::``, ``127.0.0.1``, a name).
        port: TCP port; 0 picks a free one (see ``port`` after ``start``).
        ready: the ``/readyz`` check; default: always ready.
    """

    def __init__(self, metrics: Metrics, host: str, port: int, ready: ReadyCheck = always_ready) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.ready = ready
        from prometheus_client import make_wsgi_app

        self._metrics_app = make_wsgi_app(metrics.registry)

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI application: GET and HEAD (the headers of a GET, no body) only; any
        other method gets 405 with ``Allow: GET, HEAD``."""
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in METHODS:
            return _text(start_response, "405 Method Not Allowed", "GET or HEAD only",
                         [("Allow", ", ".join(METHODS))])
        body = self._route({**environ, "REQUEST_METHOD": "GET"}, start_response)
        if method == "HEAD":
            if hasattr(body, "close"):
                body.close()
            return []
        return body

    def _route(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok")
        if path == "/readyz":
            ok, reason = self.ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", reason)
        if path == "/":
            return _text(start_response, "200 OK", "neardup: /metrics /healthz /readyz")
        return _text(start_response, "404 Not Found", "not found")

    def start(self) -> MetricsServer:
        """Listen and serve in a daemon thread.

        Raises:
            ServerError: the address cannot be bound.
        """
        self._listen(self.app, "metrics")
        log.info("serving /metrics, /healthz and /readyz on %s:%d", self.host, self.port)
        return self


def _serve(host: str, port: int, app: Callable[..., Iterable[bytes]],
           what: str) -> tuple[WSGIServer, threading.Thread, int]:
    """(server, its daemon thread, the port bound) for ``app`` on ``host:port``.

    Raises:
        ServerError: the address cannot be bound.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_Server", (_ThreadingWSGIServer,), {"address_family": family})
        server: WSGIServer = make_server(host, port, app, server_class, _QuietHandler)
    except OSError as exc:
        raise ServerError(f"cannot serve {what} on {host}:{port}: {exc}") from exc
    thread = threading.Thread(target=server.serve_forever, name=f"neardup-{what}", daemon=True)
    thread.start()
    return server, thread, server.server_port


def _stop(server: WSGIServer | None, thread: threading.Thread | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
    if thread is not None:
        thread.join(timeout=5)


def _url(host: str, port: int) -> str:
    host = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


#: Neighbours a query may ask for at most.
MAX_K = 100


class QueryServer(_Served):
    """``POST /query`` on ``host:port``: the nearest stored documents of texts, read from
    the live state of ``neardup run`` without adding them (``neardup.query.nearest`` with
    ``shared``: the state between two commits; a commit waits for at most one query's
    read of the store).

    Request: a JSON object, ``{"text": "..."}`` or ``{"texts": ["...", ...]}``, and
    optionally ``"k"`` (neighbours per text, 1 to ``MAX_K``, default 5); with a ``token``,
    the header ``Authorization: Bearer <token>``. Answer (200, JSON): ``{"nearest": [...]}``
    for ``text``, ``{"results": [{"nearest": [...]}, ...]}`` for ``texts``, each neighbour
    ``{"id", "similarity", "jaccard", "containment", "cluster"}``, most similar first.
    Errors (JSON ``{"error": "<one line>"}``): 400 (not a JSON object of that shape), 401
    (token missing or wrong), 404, 405 (not POST), 411 (no ``Content-Length``), 413 (body
    over ``max_bytes``), 503 (the state is being restored from its changelog), 500 (a
    fault of the server, logged with its traceback).

    Args:
        store: the open state store the consumer writes.
        settings: its engine settings.
        host: address to listen on (default use: ``127.0.0.1``, this host only).
        port: TCP port; 0 picks a free one (see ``port`` after ``start``).
        token: the bearer token requests must carry; None: no authentication.
        max_bytes: the largest request body accepted, bytes.
    """

    def __init__(self, store: KeyValueStateStore, settings: EngineSettings, host: str, port: int,
                 token: str | None = None, max_bytes: int = 1 << 20) -> None:
        from neardup.detector import Preparer

        self.store = store
        self.settings = settings
        self.host = host
        self.port = port
        self.token = token
        self.max_bytes = max_bytes
        self._prepare = Preparer(settings)
        self._prepare_lock = threading.Lock()  # a Preparer's buffers serve one call at a time

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI application (see the class docstring)."""
        import orjson

        def answer(status: str, body: object, headers: Sequence[tuple[str, str]] = ()) -> Iterable[bytes]:
            data = orjson.dumps(body) + b"\n"
            start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                    *headers])
            return [data]

        if (environ.get("PATH_INFO") or "/") != "/query":
            return answer("404 Not Found", {"error": "not found: the endpoint is POST /query"})
        if environ.get("REQUEST_METHOD") != "POST":
            return answer("405 Method Not Allowed", {"error": "POST only"}, [("Allow", "POST")])
        if self.token is not None:
            given = environ.get("HTTP_AUTHORIZATION", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return answer("401 Unauthorized", {"error": "a bearer token is required"},
                              [("WWW-Authenticate", "Bearer")])
        try:
            length = int(environ.get("CONTENT_LENGTH") or "")
        except ValueError:
            return answer("411 Length Required", {"error": "Content-Length is required"})
        if length > self.max_bytes:
            return answer("413 Content Too Large", {"error": f"the body is {length} bytes, over the limit of "
                                                              f"{self.max_bytes} (--query-max-bytes)"})
        try:
            texts, one, k = _query_request(orjson.loads(environ["wsgi.input"].read(length)))
        except (orjson.JSONDecodeError, ValueError) as exc:
            return answer("400 Bad Request", {"error": f"{exc}"})
        from neardup.query import nearest
        from neardup.state.errors import StateError

        try:
            with self._prepare_lock:
                found = nearest(self.store, self.settings, texts, k, self._prepare, shared=True)
        except StateError as exc:
            return answer("503 Service Unavailable", {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a fault of this server, not of the request
            log.exception("query failed")
            return answer("500 Internal Server Error", {"error": f"the query failed: {exc}"})
        results = [{"nearest": [n.to_dict() for n in neighbours]} for neighbours in found]
        return answer("200 OK", results[0] if one else {"results": results})

    def start(self) -> QueryServer:
        """Listen and serve in a daemon thread.

        Raises:
            ServerError: the address cannot be bound.
        """
        self._listen(self.app, "queries")
        log.info("serving POST /query on %s:%d%s", self.host, self.port,
                 " (bearer token required)" if self.token is not None else "")
        return self


def _query_request(body: object) -> tuple[list[str], bool, int]:
    """(texts, whether one ``text`` was asked, k) of a decoded request body.

    Raises:
        ValueError: the body is not ``{"text": str}`` or ``{"texts": [str, ...]}`` with an
            optional integer ``k`` from 1 to ``MAX_K``.
    """
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"text": "..."} or {"texts": ["...", ...]}')
    if ("text" in body) == ("texts" in body):
        raise ValueError('give either "text" or "texts"')
    one = "text" in body
    texts = [body["text"]] if one else body["texts"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError('"text" must be a string, "texts" a list of strings')
    k = body.get("k", 5)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f'"k" must be an integer from 1 to {MAX_K}')
    return texts, one, k
