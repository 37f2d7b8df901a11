"""The vLLM plugin imports nothing of the search extra (optuna, pandas, matplotlib, typer, rich): loaded the
way vLLM loads it, with a table named, and serving a linear and a norm built by vLLM.

It runs in a fresh interpreter of the vLLM virtualenv (this process's pytest and the other tests have imported
whatever they import). vLLM itself may import some of those packages (its CLI brings rich and typer), so
what tunekit imports is watched at the import statement (``builtins.__import__``, which sees a module
already loaded too): no tunekit module may import one. Of those vLLM had not loaded, none may be loaded
after the plugin served, and no module of the command side (tunekit.cli, tunekit.search,
tunekit.evidence) may be loaded at all. The main tier's half: tests/test_serving_install.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEARCH_EXTRA = ("optuna", "pandas", "matplotlib", "typer", "rich")
#: and what only they bring (optuna's SQLAlchemy and alembic, typer's click)
SEARCH_ONLY = (*SEARCH_EXTRA, "sqlalchemy", "alembic", "click")

CHILD = r"""
import builtins, json, os, socket, sys

HEAVY = set(sys.argv[2].split(","))
caught = []
_import = builtins.__import__


def _watch(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if importer.partition(".")[0] == "tunekit" and not level and name.partition(".")[0] in HEAVY:
        caught.append(f"{importer} imports {name}")
    return _import(name, globals, locals, fromlist, level)


builtins.__import__ = _watch

import torch
import vllm
import vllm.plugins
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

before = {m.partition(".")[0] for m in sys.modules} & HEAVY
os.environ["TUNEKIT_TABLE"] = sys.argv[1]
vllm.plugins.load_general_plugins()  # vLLM's way: the entry point's register()
from tunekit.integrations.vllm import plugin

installed = sorted(plugin.installed())
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                    compilation_config=CompilationConfig(mode=CompilationMode.NONE))
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6, dtype=torch.bfloat16)
    linear = ReplicatedLinear(64, 96, bias=False, params_dtype=torch.bfloat16)
    linear.weight.data.normal_(0, 64**-0.5)
    with torch.no_grad():
        y, _ = linear(norm(torch.randn(1, 64, dtype=torch.bfloat16)))
from tunekit import ops

print(json.dumps({
    "installed": installed,
    "served": sorted({(r["op"], r["impl"]) for r in ops.dispatch_stats()}),
    "caught": caught,
    "new": sorted({m.partition(".")[0] for m in sys.modules} & HEAVY - before),
    "vllm_had": sorted(before),
    "command_side": sorted(m for m in sys.modules if m.startswith(("tunekit.cli", "tunekit.search",
                                                                  "tunekit.evidence"))),
}))
"""


def _table(path: Path) -> Path:
    from tunekit import table as table_mod
    from tunekit.backends import get
    from tunekit.measure.device import detect
    from tunekit.problems.shapes import Problem

    entries = []
    for op, n, k in (("gemv", 96, 64), ("rms_norm", 64, 64)):
        params = get("triton").space(Problem(op, "bf16", 1, n, k)).default
        entries.append({"op": op, "dtype": "bf16", "m": 1, "n": n, "k": k, "backend": "triton", "params": params,
                        "kernel": "test", "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0})
    table = {"format": table_mod.FORMAT, "created": "test", "environment": table_mod.environment_stamp(
        detect().as_dict(), []), "read_limit_gbps": None, "entries": entries}
    return table_mod.save(table, path)


def test_the_plugin_loaded_and_serving_imports_nothing_of_the_search_extra(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TUNEKIT_TABLE", "VLLM_PLUGINS")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", CHILD, str(_table(tmp_path / "t.json")), ",".join(SEARCH_ONLY)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"linear", "RMSNorm"} <= set(out["installed"]), out
    assert ["gemv", "tuned:triton"] in out["served"] and ["rms_norm", "tuned:triton"] in out["served"], out
    assert out["caught"] == [], f"tunekit modules imported the search extra: {out['caught']}"
    assert out["new"] == [], f"loaded after the plugin served (vLLM had {out['vllm_had']}): {out['new']}"
    assert out["command_side"] == [], out["command_side"]
