"""A stand-in for ``python -m vllm.entrypoints.cli.main serve MODEL --port P ...`` in the tests of
benchmarks/endpoint_ab.sh: an OpenAI-style streaming completions server (standard library only).

Its decode speed follows the arm its environment makes it (tunekit in VLLM_PLUGINS and a TUNEKIT_TABLE:
10 ms per token, else 20 ms). At start it records its argv and environment to
FAKE_SERVE_RECORD/<port>.json; on SIGINT it writes TUNEKIT_DISPATCH_LOG ({pid} expanded) when set,
then exits, as vLLM's server does on a clean shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    argv = sys.argv[1:]
    assert argv[0] == "serve", argv
    model, port = argv[1], int(argv[argv.index("--port") + 1])
    plugins = os.environ.get("VLLM_PLUGINS")
    tuned = plugins is not None and "tunekit" in plugins.split(",") and bool(os.environ.get("TUNEKIT_TABLE"))
    tpot_s = 0.010 if tuned else 0.020  # large against scheduling noise on a busy 2-core machine
    record = Path(os.environ["FAKE_SERVE_RECORD"])
    record.mkdir(parents=True, exist_ok=True)
    (record / f"{port}.json").write_text(json.dumps({"argv": argv, "pid": os.getpid(), "env": {
        k: os.environ.get(k) for k in ("VLLM_PLUGINS", "TUNEKIT_TABLE", "TUNEKIT_DISPATCH_LOG")}}))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            body = json.dumps({"object": "list", "data": [{"id": model}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(req["max_tokens"]):
                time.sleep(0.003 if i == 0 else tpot_s)
                chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    time.sleep(float(os.environ.get("FAKE_SERVE_START_S", "0.5")))  # an engine start: the script must wait
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True

    def shutdown(*_: object) -> None:
        target = os.environ.get("TUNEKIT_DISPATCH_LOG")
        if target:
            Path(target.replace("{pid}", str(os.getpid()))).write_text(json.dumps(
                {"format": "tunekit.dispatch_stats/1", "pid": os.getpid(), "calls": []}))
        os._exit(0)

    signal.signal(signal.SIGINT, shutdown)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
