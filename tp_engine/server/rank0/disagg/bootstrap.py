"""The prefill's bootstrap server (SGLang's `--disaggregation-bootstrap-port`, 8998): where a
decode server learns, once per prefill, what it is pairing with and where to send its requests.

    GET /health                       200 "OK"
    GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1
                                      the prefill's facts: tensor-parallel size, page size, KV
                                      dtype, layers, its model, and the ZeroMQ address of its
                                      rank 0 for `KVRequest`s; 503 until every rank's KV agent
                                      has reported (SGLang's `_is_ready`)
    GET /route?target_tp_rank=T       rank T's agent: its address and transfer-engine session

Its own thread (the standard library's threading HTTP server), never the engine loop's or the
API process's event loop; the facts are set once, before the server answers anything but 503.
The ranks report to rank 0 over ZeroMQ (`agents`) rather than SGLang's `PUT /route`: both are
this server's own processes.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

__all__ = ["BootstrapServer"]


class BootstrapServer:
    """See the module docstring."""

    def __init__(self, host: str, port: int) -> None:
        self.info: dict[str, Any] | None = None
        self.ranks: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = server.answer(self.path)
                data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("bootstrap: " + format, *args)

        try:
            self._http = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise RuntimeError(
                f"the bootstrap server cannot listen on {host}:{port} ({exc.strerror}); "
                "give another --disaggregation-bootstrap-port"
            ) from None
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="pd-bootstrap", daemon=True
        )
        self._thread.start()

    def ready(self, info: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
        """Every rank reported: answer with these from now on."""
        self.ranks = ranks
        self.info = info

    def answer(self, path: str) -> tuple[int, Any]:
        url = urlparse(path)
        if url.path == "/health":
            return 200, "OK"
        if url.path != "/route":
            return 404, {"error": f"no route {url.path}"}
        if self.info is None:
            return 503, {"error": "the prefill's ranks are not all registered yet"}
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        try:
            tp_rank = int(query.get("target_tp_rank", "-1"))
        except ValueError:
            return 400, {"error": "target_tp_rank must be an integer"}
        if tp_rank == -1:
            return 200, self.info
        if not 0 <= tp_rank < len(self.ranks):
            return 404, {"error": f"no tensor-parallel rank {tp_rank} (size {len(self.ranks)})"}
        return 200, self.ranks[tp_rank]

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
