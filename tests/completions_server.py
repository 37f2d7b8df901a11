"""A streaming ``/v1/completions`` stand-in in vLLM's OpenAI form (standard library only), shared by the
endpoint tests' in-process servers and the stand-in ``vllm serve`` of tests/data/fake_vllm_serve.

``GET /v1/models`` lists ``model``; a completion takes token-id prompts only (vLLM's form with
``--skip-tokenizer-init``), waits ``prefill_s``, then streams ``max_tokens`` chunks ``tpot_s`` apart and a
final ``usage`` chunk. Each request body is appended to ``seen`` when given.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler


def handler_class(model: str, tpot_s: float, seen: list[dict] | None = None,
                  prefill_s: float = 0.005) -> type[BaseHTTPRequestHandler]:
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
            if seen is not None:
                seen.append(req)
            if not isinstance(req["prompt"], list):
                self.send_error(400, "prompt must be token ids here")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(prefill_s)
            for i in range(req["max_tokens"]):
                if i:
                    time.sleep(tpot_s)
                chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]),
                                              "completion_tokens": req["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    return Handler
