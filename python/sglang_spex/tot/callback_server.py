"""A ``callback`` reward endpoint in a background thread: serve ``score(body) -> reward`` for searches to call.

The ``callback`` reward (:mod:`sglang_spex.tot.rewards`) POSTs each node as JSON (question, path, depth, text,
trajectory, answer, terminal) and expects ``{"reward": number}``. This serves a Python function that way, one
thread per request, optionally after a fixed latency (e.g. to stand in for a PRM on other hardware). A ``score``
that raises answers HTTP 500 with the error, which the search records as that node's failure.

    with CallbackRewardServer(lambda body: my_score(body["trajectory"])) as cb:
        spec["reward"] = {"type": "callback", "url": cb.url}
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict

Score = Callable[[Dict[str, Any]], float]


class _ThreadingServer(ThreadingHTTPServer):
    """One thread per request, and a listen backlog that holds a whole search's concurrent reward calls.

    ``socketserver``'s default backlog of 5 overflows when a search posts a wave of nodes at once: the kernel then
    resets connections or drops SYNs (the client retries after 1 s), which shows up as failed or late rewards.
    """

    daemon_threads = True
    request_queue_size = 1024  # the kernel caps it at net.core.somaxconn


class CallbackRewardServer:
    """``POST <url>`` -> ``{"reward": score(body)}`` after ``latency_s`` (concurrent requests wait concurrently);
    ``calls`` counts the requests taken in."""

    def __init__(self, score: Score, latency_s: float = 0.0, host: str = "127.0.0.1"):
        if latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        self.latency_s, self.calls = float(latency_s), 0
        calls_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                started = time.monotonic()
                with calls_lock:
                    server.calls += 1
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    code, payload = 200, {"reward": float(score(body))}
                except Exception as e:  # the scorer's failure is the node's, never the server's
                    code, payload = 500, {"error": repr(e)}
                time.sleep(max(0.0, server.latency_s - (time.monotonic() - started)))
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the caller gave up first (its reward timeout); nothing to answer
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = _ThreadingServer((host, 0), Handler)
        self.url = f"http://{host}:{self._httpd.server_address[1]}/score"
        threading.Thread(target=self._httpd.serve_forever, name="callback-reward", daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "CallbackRewardServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
