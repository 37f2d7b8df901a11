"""``TUNEKIT_TABLE=auto`` served by the vLLM plugin, in real vLLM 0.33 on the CPU (run in the vLLM virtualenv).

The shipped set is two test tables: one stamped for this device (the CPU under the interpreter; timed with
older software, as the real shipped tables are) with a right GEMV entry and a wrong one
(``fault_backend:WRONG``), one stamped for an H200. What is checked: the plugin's register installs its hooks
for ``auto`` (compile ranges from the shipped tables' Ms) without checking anything or touching a GPU; its
load hook checks them on the device, logs the one line (kept, dropped, refused), and serves what passed: the
right entry's linear routes to tunekit, the wrong entry's and the foreign table's take vLLM's own GEMM; what
the check kept joins the compile-cache key.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import test_vllm_plugin as base
import torch
import torch.nn.functional as F
from test_vllm_plugin import _entry, _impls
from torch import nn

from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.integrations.vllm import state as vllm_state

# the session's plugin (registered with its own table) goes in before this module's register: vLLM loads
# general plugins once per process, and the other modules' tests count that first register's line
plugin, _fresh_ops = base.plugin, base._fresh_ops
K = 64
GOOD, WRONG, FOREIGN = 48, 32, 16  # the Ns of the right entry, the wrong one, the H200 table's


def _ship(path: Path, entries: list[dict], **stamp) -> None:
    from tunekit import table as table_mod
    from tunekit.measure.device import detect

    env = dict(table_mod.environment_stamp(detect().as_dict(), []), **stamp)
    table = {"format": table_mod.FORMAT, "created": "test", "environment": env, "read_limit_gbps": None,
             "entries": entries, "shipped": {"gpu": env["gpu"], "model": "tiny", "ms": [2]}}
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table))


@pytest.fixture
def shipped_set(tmp_path: Path, monkeypatch):
    from tunekit import shipped

    root = tmp_path / "tables"
    _ship(root / "cpu" / "tiny.json", [_entry("gemv", 2, GOOD, K), _entry("gemv", 2, WRONG, K, "fault_backend:WRONG")],
          torch="0.0.1")  # measured with other software: as stamped, serving refuses it; checked, it serves
    _ship(root / "nvidia-h200" / "tiny.json", [_entry("gemv", 2, FOREIGN, K)], gpu="NVIDIA H200", arch="sm_90",
          cu_count=132, wave_size=32, runtime="12.8")
    monkeypatch.setattr(shipped, "TABLES_DIR", root)
    monkeypatch.setenv("TUNEKIT_TABLE", "auto")
    return root


def test_auto_is_checked_in_the_worker_after_the_load_and_serves_what_passed(plugin, vllm_config, shipped_set,
                                                                             monkeypatch) -> None:
    import vllm.envs as envs
    from vllm.compilation.passes import pass_manager
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.model_loader import base_loader

    from tunekit.dispatch import auto

    checks = []
    check = auto.check
    monkeypatch.setattr(auto, "check", lambda *a, **k: checks.append(1) or check(*a, **k))
    # a fresh process's plugin; its compile factor and log lines are put back for the other tests of this process
    # (the plugin's modules hold the one STATE dict: its keys are set, not the dict replaced)
    for key, value in {"registered": False, "installed": {}, "skipped": {}, "fold_outcome": [],
                       "shipped_outcome": ""}.items():
        monkeypatch.setitem(vllm_state.STATE, key, value)
    monkeypatch.setitem(envs.environment_variables, vllm_compile.COMPILE_FACTOR,
                        envs.environment_variables.get(vllm_compile.COMPILE_FACTOR))
    # and the compile-range hooks it wraps, as tests/vllm/test_vllm_fold.py's compile_ranges fixture puts them
    # back: the range pass caches its uuid, and a later test's tables must get a pass of their own
    monkeypatch.setattr(VllmConfig, "_set_compile_ranges", VllmConfig._set_compile_ranges)
    monkeypatch.setattr(pass_manager.PostGradPassManager, "configure", pass_manager.PostGradPassManager.configure)
    # this register's INFO "installed" line would count as the session fixture's (test_vllm_plugin's
    # _install_logs): the logger keeps WARNING and up here, the check's line among them
    plugin_log = logging.getLogger("vllm.tunekit")
    level, heard = plugin_log.level, base._Records()
    plugin_log.setLevel(logging.WARNING)  # setLevel: it clears the logger's cache of enabled levels
    plugin_log.addHandler(heard)
    model = nn.Module()
    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", lambda self, *args, **kwargs: model)
    try:
        plugin.register()  # as vLLM calls it in every process: no check, no GPU
        assert checks == [] and not torch.cuda.is_initialized()
        assert {"linear", "compile_cache_key", "compile_ranges", "fold_norms", "check_shipped"} <= set(
            plugin.installed()), plugin.skipped()
        # the ranges come from the shipped tables' Ms, unchecked (compile.tables_tops says why that is harmless)
        assert "the tables' largest M is 2" in plugin.installed()["compile_ranges"]
        with set_current_vllm_config(vllm_config):
            for n in (GOOD, WRONG, FOREIGN):
                layer = ReplicatedLinear(K, n, bias=False, params_dtype=torch.bfloat16)
                layer.weight.data.normal_(0, K**-0.5)
                model.add_module(f"n{n}", layer)
        before = vllm_compile.load_outcome()
        # the worker: the weights load, then the plugin's load hook checks the shipped tables on the device
        assert base_loader.BaseModelLoader.load_model(None, vllm_config=None, model_config=None) is model
    finally:
        plugin_log.removeHandler(heard)
        plugin_log.setLevel(level)
    lines = [r for r in heard.records if "auto tables" in r.getMessage()]
    assert checks == [1] and len(lines) == 1 and lines[0].levelno == logging.WARNING
    line = lines[0].getMessage()
    assert line.startswith("tunekit vLLM plugin: auto tables on ")
    assert f"used {plugin_cpu_name()}/tiny: 1 of 2 entries passed their check" in line
    assert "timed with other software: torch: table '0.0.1'" in line
    assert f"dropped 1: gemv m2 {WRONG}x{K} fault_backend:WRONG:" in line
    assert "refused NVIDIA H200/tiny: measured on another GPU" in line
    # what the check kept joins the compile-cache key, read at compile time
    assert vllm_state.STATE["shipped_outcome"] and vllm_compile.load_outcome() not in ("", before)
    assert envs.compile_factors()[vllm_compile.COMPILE_FACTOR] == (vllm_compile.tables_digest()
                                                                   + vllm_compile.load_outcome())
    x = torch.randn(2, K).bfloat16()
    for n in (GOOD, WRONG, FOREIGN):
        layer = getattr(model, f"n{n}")
        y, _ = layer(x)
        if n == GOOD:
            ref = x.double() @ layer.weight.data.double().T
            assert (y.double() - ref).abs().max() < 0.05
        else:  # the dropped entry's shape and the foreign table's: vLLM's own GEMM, F.linear's bits
            assert torch.equal(y, F.linear(x, layer.weight))
    assert _impls() == [("gemv", f"{GOOD}x{K}", 2, "tuned:triton")]
    assert not torch.cuda.is_initialized()


def plugin_cpu_name() -> str:
    from tunekit.measure.device import detect

    return detect().name
