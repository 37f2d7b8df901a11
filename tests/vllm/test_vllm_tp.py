"""Tensor parallelism on the vLLM tier: a TP=2 layer's local shapes, served from a ``--tp 2`` table.

Two CPU processes form a real 2-way tensor-parallel group (vLLM's
``init_distributed_environment`` over gloo, ``initialize_model_parallel(2)``),
each with the plugin loaded the way vLLM loads it. Each rank builds vLLM's
``ColumnParallelLinear(64 -> 96)`` (its shard: N = 48, K = 64) and
``RowParallelLinear(96 -> 64)`` (its shard: N = 64, K = 48), and runs them:

* under a table that records ``tp: 2`` and holds those shards' shapes, both
  layers are served tuned on both ranks, within the bound of the fp64 result;
* under the same entries in a table that records ``tp: 1``, both layers keep
  vLLM's own GEMM (F.linear's bits) and the markers say why
  (``fallback:tp_mismatch``, ``counted_at: layer``), with one warning naming
  the table's TP.

The shard shapes are the ones ``tunekit search --model M --tp 2`` lists for
such layers (column-parallel: N / 2; row-parallel: K / 2).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K, N = 64, 96
SHARDS = {"column": (N // 2, K), "row": (K, N // 2)}  # (N, K) of one rank's weight at TP 2

CHILD = r'''
import json, logging, os, sys
import torch
import torch.nn.functional as F
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("tunekit.ops").addHandler(Keep())
import vllm.plugins
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
config = VllmConfig(device_config=DeviceConfig(device="cpu"),
                    compilation_config=CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode="NONE"))
result = {}
with set_current_vllm_config(config):
    init_distributed_environment(world_size=2, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(2, 1)
    vllm.plugins.load_general_plugins()
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from tunekit import ops
    torch.manual_seed(0)
    column = ColumnParallelLinear(64, 96, bias=False, params_dtype=torch.bfloat16)
    row = RowParallelLinear(96, 64, bias=False, params_dtype=torch.bfloat16, reduce_results=False)
    for layer in (column, row):
        layer.weight.data.normal_(0, layer.weight.shape[1] ** -0.5)
    for name in ("tp2", "tp1"):
        ops.load_tables(os.environ["TABLE_" + name.upper()])
        ops.reset_stats()
        x = torch.randn(1, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
        h, _ = column(x)
        y, _ = row(h)
        errs = []
        for layer, inp, got in ((column, x, h), (row, h, y)):
            ref = inp.double() @ layer.weight.data.double().T
            errs.append([float((got.double() - ref).abs().max()), torch.equal(got, F.linear(inp, layer.weight)),
                         float(ref.abs().max())])
        result[name] = {"shapes": [list(column.weight.shape), list(row.weight.shape)], "errs": errs,
                        "stats": ops.dispatch_stats(), "tables": ops.loaded_tables()}
    result["log"] = records
json.dump(result, open(out, "w"))
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _table(path: Path, tp: int) -> Path:
    from test_vllm_plugin import _entry

    from tunekit import table as table_mod
    from tunekit.measure.device import detect

    entries = [_entry("gemv", m, n, k) for n, k in SHARDS.values() for m in (1, 2)]
    table = {"format": table_mod.FORMAT, "created": "test", "tp": tp, "read_limit_gbps": None,
             "environment": table_mod.environment_stamp(detect().as_dict(), []), "entries": entries}
    return table_mod.save(table, path)


def test_a_tp2_layer_is_served_from_a_tp2_table_and_falls_back_under_a_tp1_table(tmp_path: Path) -> None:
    env = {**os.environ, "TABLE_TP2": str(_table(tmp_path / "tp2.json", 2)),
           "TABLE_TP1": str(_table(tmp_path / "tp1.json", 1)),
           "TUNEKIT_TABLE": str(tmp_path / "tp2.json"), "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    outs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(port), str(outs[r])], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    for out in outs:
        result = json.loads(out.read_text())
        tp2, tp1 = result["tp2"], result["tp1"]
        # one rank's shards: the shapes a --tp 2 table holds
        assert [tuple(s) for s in tp2["shapes"]] == list(SHARDS.values())
        assert tp2["tables"][0]["tp"] == 2 and tp1["tables"][0]["tp"] == 1
        served = {(r["shape"], r["impl"], r["counted_at"]) for r in tp2["stats"]}
        assert served == {(f"{n}x{k}", "tuned:triton", "call") for n, k in SHARDS.values()}, tp2["stats"]
        assert all(err <= 2**-6 * top for err, _, top in tp2["errs"]), tp2["errs"]  # BF16 outputs, K <= 96
        # the TP-1 table holds the same shapes: the layers keep vLLM's GEMM, and the markers say why
        fell = {(r["shape"], r["impl"], r["counted_at"], r["vendor"]) for r in tp1["stats"]}
        assert fell == {(f"{n}x{k}", "fallback:tp_mismatch", "layer", "vllm") for n, k in SHARDS.values()}, fell
        assert all(same for _, same, _ in tp1["errs"]), tp1["errs"]
        warned = [line for line in result["log"] if "tuned for tp=1, this process serves tp=2" in line]
        assert len(warned) == 1, result["log"]
