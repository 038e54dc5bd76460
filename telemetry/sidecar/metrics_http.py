"""/metrics over HTTP, always in Prometheus' classic text format (version 0.0.4).

Prometheus asks for OpenMetrics first, and prometheus_client's OpenMetrics writer rewrites
':' in sample names: with ``--vllm-compatible-names``, ``vllm:num_requests_running`` reached
Prometheus as ``vllm_num_requests_running`` and vLLM's dashboards and rules found nothing.
The text format keeps the names as they are, and it is what every Prometheus scrapes. Every
path answers with the metrics, as prometheus_client's own server does, but the JSON routes
given to ``serve_metrics`` (``/findings``: the live findings).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

TEXT_FORMAT = "text/plain; version=0.0.4"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape."""


def text_format_only(app: Callable) -> Callable:
    """The WSGI app with the scraper's Accept header replaced by the text format's."""

    def app_in_text_format(environ: dict, start_response: Callable) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return app(environ, start_response)

    return app_in_text_format


def with_json_routes(app: Callable, routes: dict[str, Callable[[], object]]) -> Callable:
    """The WSGI app, but each path of ``routes`` answers with its function's value as JSON."""

    def app_with_routes(environ: dict, start_response: Callable) -> Iterable[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return app(environ, start_response)
        body = json.dumps(route(), indent=1).encode()
        start_response(
            "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]

    return app_with_routes


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    json_routes: dict[str, Callable[[], object]] | None = None,
) -> WSGIServer:
    """Serve ``registry`` on http://host:port/ from a daemon thread (port 0: any free one),
    and ``json_routes`` (path -> a function whose value is served as JSON); IPv6 hosts work
    too. Stop it with shutdown() and server_close()."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    app = with_json_routes(text_format_only(make_wsgi_app(registry)), json_routes or {})
    server = make_server(address[0], port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def metrics_url(host: str, port: int) -> str:
    """The URL a process on this host reaches /metrics at, when served on ``host``:``port``
    (a wildcard address is reached through loopback)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def write_metrics_url(path: str, url: str) -> None:
    """Write ``url`` to ``path`` whole or not at all (a reader never sees half of it)."""
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        file.write(url + "\n")
    os.replace(partial, path)
