"""The operations HTTP server: Prometheus ``/metrics``, ``/healthz`` and ``/readyz``.

prometheus_client's WSGI app serves the metrics; the standard library's ``wsgiref``
server runs it, one thread per request, in a daemon thread. Paths:

- ``/metrics``: the ``Metrics`` registry in the Prometheus text format.
- ``/healthz``: 200 ``ok`` while the process is alive (liveness).
- ``/readyz``: 200 when the ``ready`` check passes, 503 otherwise; the body says why in
  one line (readiness).

Every path answers GET and HEAD only (405 otherwise).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:  # prometheus_client is imported when a server starts, not by every command
    from neardup.io.progress import Progress
    from neardup.metrics import Metrics

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], tuple[bool, str]]


class ServerError(RuntimeError):
    """The server cannot listen on the address (port in use, unknown host)."""


class Readiness:
    """Readiness of a Kafka consumer: partitions assigned, the broker heard from within
    ``broker_timeout`` seconds, and not stalled (``progress``: input waiting with no batch
    committed for longer than its ``stall_after``, ``neardup.io.progress``). Thread-safe;
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


class MetricsServer:
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
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

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
        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            server_class = type("_Server", (_ThreadingWSGIServer,), {"address_family": family})
            self._server = make_server(self.host, self.port, self.app, server_class, _QuietHandler)
        except OSError as exc:
            raise ServerError(f"cannot serve metrics on {self.host}:{self.port}: {exc}") from exc
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="neardup-metrics", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on %s:%d", self.host, self.port)
        return self

    @property
    def url(self) -> str:
        """Base URL of the server, for clients on this host."""
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
