"""An example reward model server for `--rm-url` (slime's `remote_rm` wire), standard library only.

Run it, then point a run at it::

    python -m slime_async.examples.reward_server --port 8000
    python train_async.py ... --rm-url http://127.0.0.1:8000

It answers ``POST /`` with a JSON body ``{"prompt": str, "response": str, "label": ...}`` by
``{"reward": r}``: 1.0 when the response's last number equals the label (as numbers; text labels
compare with the response's last word), else 0.0. Replace `score` with a real reward model.
It binds 127.0.0.1 unless `--host` says otherwise, reads bodies up to 1 MiB, takes JSON only
(nothing is unpickled), and answers 400 to a body it cannot read. With `--port 0` it picks a
free port; the first line it prints is its URL.
"""

from __future__ import annotations

import argparse
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(prompt: str, response: str, label: Any) -> float:
    """1.0 when the last number (or, for a text label, the last word) of `response` is `label`."""
    del prompt
    want = str(label).strip()
    if _NUMBER.fullmatch(want):
        found = _NUMBER.findall(response)
        return float(bool(found) and float(found[-1]) == float(want))
    words = response.split()
    return float(bool(words) and words[-1].strip(".!") == want)


class Handler(BaseHTTPRequestHandler):
    """POST / -> {"reward": score(...)}; anything unreadable -> 400 naming the problem."""

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            return self._answer(413, {"error": f"body over {MAX_BODY} bytes"})
        try:
            body = json.loads(self.rfile.read(size))
            reward = score(str(body["prompt"]), str(body["response"]), body["label"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            return self._answer(400, {"error": f"expected JSON {{prompt, response, label}}: {e}"})
        self._answer(200, {"reward": reward})

    def _answer(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per request would drown a run's log."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    args = p.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
