"""A stand-in for ``python -m vllm.entrypoints.cli.main serve MODEL --port P ...`` in the tests of
benchmarks/endpoint_ab.sh: the tests' streaming completions server (tests/completions_server.py) in a process.

Its decode speed follows the arm its environment makes it (tunekit in VLLM_PLUGINS and a TUNEKIT_TABLE:
10 ms per token, else 20 ms). At start it records its argv and environment to
FAKE_SERVE_RECORD/<port>.json; on SIGINT it writes TUNEKIT_DISPATCH_LOG ({pid} expanded) when set,
then exits, as vLLM's server does on a clean shutdown (with the model's calls only when started with a
``--shutdown-timeout``, as vLLM's engine core).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

# the tests' shared completions stand-in (tests/completions_server.py); this file runs as its own process
sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from completions_server import handler_class  # noqa: E402


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

    time.sleep(float(os.environ.get("FAKE_SERVE_START_S", "0.5")))  # an engine start: the script must wait
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_class(model, tpot_s, prefill_s=0.003))
    server.daemon_threads = True

    # As vLLM 0.26: the model runs in an engine core process that a stopping server kills before its exit
    # hooks run, unless --shutdown-timeout lets it drain. So the log holds the model's calls only then.
    drained = "--shutdown-timeout" in argv and int(argv[argv.index("--shutdown-timeout") + 1]) > 0
    calls = [{"op": "gemv", "dtype": "bf16", "shape": "8x8", "m": m, "bias": False, "impl": "tuned:triton",
              "vendor": None, "calls": 64, "counted_at": "capture"} for m in (1, 2)] if drained else []

    def shutdown(*_: object) -> None:
        target = os.environ.get("TUNEKIT_DISPATCH_LOG")
        if target:
            Path(target.replace("{pid}", str(os.getpid()))).write_text(json.dumps(
                {"format": "tunekit.dispatch_stats/1", "pid": os.getpid(), "calls": calls}))
        os._exit(0)

    signal.signal(signal.SIGINT, shutdown)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
