"""The fold by default, checked on the loaded weights, and folded again when weights are written later, in
real vLLM 0.33 on the CPU (run in the vLLM virtualenv).

The two-layer model of tests/vllm/test_vllm_fold.py (vLLM's RMSNorm, ReplicatedLinear, SiluAndMul; decoder
layers named as vLLM's Qwen3 one), loaded through the plugin's load hook. What is checked: with no
switch set the decoder norms fold, each checked first, and ``plugin.installed()`` says what was folded,
kept unfolded, why, and what the checks cost; norm gains with outlier channels (above 10, near 0, 0) pass;
a table whose rms_gemv and gemv_add kernels are broken is caught at load, every norm stays unfolded,
no residual add is routed to gemv_add, and the model serves the unfolded math; an engine with LoRA
folds nothing; weights written later (``reload_weights`` in checkpoint and kernel format, a worker's
weight-update session, per-parameter ``load_weights`` calls, sleep and wake-up) are folded again,
and the outputs match vLLM's own model on the new weights as closely as the unfolded model does.

Sleep mode does not run on the CPU (vLLM's CPUWorker.sleep / wake_up only log a warning), nor do the
weight-transfer engines (NCCL, CUDA IPC): the tests reach the plugin's hooks on vLLM's ``Worker``
methods, whose bodies are stubbed to do what the GPU worker does to the weights (level 1: the bytes
offloaded and put back; level 2: discarded) and what an engine does (``model.load_weights`` per chunk
between ``start_weight_update`` and ``finish_weight_update``).
"""

from __future__ import annotations

import types

import pytest
import test_vllm_fold as fold_tests
import test_vllm_plugin as base
import torch
from test_vllm_plugin import PLUGIN_LOG, _impls
from torch import nn

from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.integrations.vllm import load as vllm_load
from tunekit.integrations.vllm import marks, refold
from tunekit.integrations.vllm import state as vllm_state

plugin, _fresh_ops, compile_ranges = base.plugin, base._fresh_ops, fold_tests.compile_ranges
H, INTER, Q = fold_tests.H, fold_tests.INTER, fold_tests.Q


@pytest.fixture(autouse=True)
def _fresh_checks():
    """Refusals and fold outcomes are per process: none leaks into another test."""
    marks.REFUSED.clear()
    refold.REFOLDS.clear()
    yield
    marks.REFUSED.clear()
    refold.REFOLDS.clear()
    vllm_state.STATE["fold_outcome"] = []


def _weights(seed: int, names: dict[str, torch.Size], outliers: bool = True) -> dict[str, torch.Tensor]:
    """Seeded weights; the norms' gains ~1 with outlier channels (above 10, near 0, exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            g = 1.0 + 0.15 * torch.randn(shape, generator=gen)
            if outliers:
                g[:4] = torch.tensor([12.0, 25.0, 1e-3, 0.0])
        else:
            g = 0.15 * torch.randn(shape, generator=gen)
        out[name] = g.bfloat16()
    return out


def _eager(config):
    """A VllmConfig whose model runs eagerly (the marks read per call, as under enforce_eager)."""
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"),
                      compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"]))


def _loaded(plugin, monkeypatch, config, state: dict, lora: bool = False) -> nn.Module:
    """The test model with ``state`` (its ``load_weights`` through each parameter's weight loader, as vLLM's
    models), loaded through the plugin's load hook of a loader whose engine runs LoRA or not."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    with set_current_vllm_config(config):
        model = fold_tests._model_class()(vllm_config=config)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model: what a layerwise reload rebuilds
    model.load_state_dict(state)

    def load_weights(weights):
        params, loaded = dict(model.named_parameters()), set()
        for name, value in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, value)
            loaded.add(name)
        return loaded

    model.load_weights = load_weights
    monkeypatch.setattr(base_loader.BaseModelLoader, "load_model", lambda self, *args, **kwargs: model)
    done, why = vllm_load.install_fold()
    if not done:  # TUNEKIT_FOLD_NORMS=0: the merge step's hook is the same load_model wrapper
        done, why = vllm_load.install_merge()
    assert done, why
    engine = types.SimpleNamespace(lora_config=object() if lora else None)
    return base_loader.BaseModelLoader.load_model(None, vllm_config=engine, model_config=None)


def _plain(config, state: dict, xs: dict) -> dict:
    """vLLM's own model (no table) on ``state``: its outputs for ``xs``."""
    from vllm.config import set_current_vllm_config

    from tunekit import ops

    ops.load_tables([])
    with set_current_vllm_config(config):
        model = fold_tests._model_class()(vllm_config=config)
        model.load_state_dict(state)
        return {m: model(x) for m, x in xs.items()}


def _assert_close(got: dict, want: dict, state: dict, xs: dict) -> None:
    """Each output as close to the fp32 model on ``state`` as vLLM's own: within twice its error (the fold
    rounds W diag(g) once where vLLM rounds the normalised activation) plus one BF16 ulp of the largest
    output (both round their output to BF16: below that, vLLM's error is luck; with gains of 25 the outputs
    reach ~30, whose ulp is 0.125, while a wrong fold errs by O(the outputs))."""
    for m, x in xs.items():
        ref = fold_tests._reference(state, x.float())
        err = (got[m].float() - ref).abs().max().item()
        floor = (want[m].float() - ref).abs().max().item()
        assert err <= 2 * floor + 2**-7 * ref.abs().max().item(), (m, err, floor)


def _xs(*ms: int) -> dict:
    return {m: torch.randn(m, H, generator=torch.Generator().manual_seed(m)).bfloat16() for m in ms}


def _names(config) -> dict:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return {k: v.shape for k, v in fold_tests._model_class()(vllm_config=config).state_dict().items()}


# ----------------------------------------------------------------------------- at load


def test_folding_is_on_by_default_checked_on_the_loaded_weights_and_reported(plugin, compile_ranges,
                                                                             monkeypatch) -> None:
    from vllm.config import set_current_vllm_config

    monkeypatch.delenv("TUNEKIT_FOLD_NORMS", raising=False)
    assert "fold_norms" in plugin.installed() and "fold_norms" not in plugin.skipped()
    config = _eager(compile_ranges(fold_tests._entries(True)))
    state, xs = _weights(0, _names(config)), _xs(1, 3)
    model = _loaded(plugin, monkeypatch, config, state)
    assert vllm_load.FOLDS == {"rms_norm folded": 4}, vllm_load.FOLD_REPORT
    report = vllm_load.FOLD_REPORT
    assert report["folded"] == 4 and report["kept unfolded"] == {} and report["not folded"] == {}
    assert report["checked"] == {"norms": 4, "linears": 4} and report["check seconds"] > 0  # o_proj, down_proj x 2
    line = plugin.installed()["fold_norms"]
    assert "; last load: folded 4; kept unfolded 0 (failed the check); gemv_add shapes refused 0; checks " in line
    assert line.endswith("s over 4 norm(s) and 4 linear(s)")
    assert any("load checks took" in r.getMessage() for r in PLUGIN_LOG.records)
    with set_current_vllm_config(config):
        got = {m: model(x) for m, x in xs.items()}
    assert ("rms_gemv", f"{Q}x{H}", 1, "tuned:triton") in _impls()
    _assert_close(got, _plain(config, state, xs), state, xs)


def test_broken_kernels_are_caught_at_load_and_the_model_serves_the_unfolded_math(plugin, compile_ranges,
                                                                                   monkeypatch) -> None:
    from vllm.config import set_current_vllm_config

    entries = [dict(e, backend="fault_backend:WRONG") if e["op"] in ("rms_gemv", "gemv_add") else e
               for e in fold_tests._entries(True)]
    config = compile_ranges(entries)  # compiled: the graph pass would fuse the residual adds
    state, xs = _weights(1, _names(config)), _xs(3)
    model = _loaded(plugin, monkeypatch, config, state)
    assert vllm_load.FOLDS == {"rms_norm (kept unfolded: failed the check)": 4}
    kept = vllm_load.FOLD_REPORT["kept unfolded"]
    assert sorted(kept) == [f"layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")]
    assert all("against a bound of" in why for why in kept.values())
    assert set(vllm_load.FOLD_REPORT["gemv_add refused"]) == {f"bf16 {H}x{Q}", f"bf16 {H}x{INTER}"}
    assert marks.REFUSED == {("gemv_add", "bf16", H, Q, "cpu"), ("gemv_add", "bf16", H, INTER, "cpu")}
    assert "kept unfolded 4 (failed the check); gemv_add shapes refused 2" in plugin.installed()["fold_norms"]
    warned = [r.getMessage() for r in PLUGIN_LOG.records if r.levelname == "WARNING"]
    assert any("layers.1.post_attention_layernorm (rms_norm) kept unfolded" in w for w in warned)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # weights untouched
    with set_current_vllm_config(config):
        got = {m: model(x) for m, x in xs.items()}
        fusions = dict(vllm_compile.RANGE_FUSIONS)
        # the same table, the fold switched off: the unfolded model this one must be
        monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "0")
        unfolded = fold_tests._model_class()(vllm_config=config)
        unfolded.load_state_dict(state)
        want = {m: unfolded(x) for m, x in xs.items()}
    assert fusions == {}  # no residual add went to the refused gemv_add
    assert not [c for c in _impls() if c[0] in ("rms_gemv", "gemv_add")]
    assert all(torch.equal(got[m], want[m]) for m in xs)


def test_an_engine_with_lora_folds_nothing(plugin, compile_ranges, monkeypatch) -> None:
    config = _eager(compile_ranges(fold_tests._entries(False)))
    state = _weights(2, _names(config))
    model = _loaded(plugin, monkeypatch, config, state, lora=True)
    assert vllm_load.FOLDS == {"rms_norm (not folded: LoRA)": 4}
    (why, names), = vllm_load.FOLD_REPORT["not folded"].items()
    assert why.startswith("LoRA") and len(names) == 4
    assert "not folded 4 (LoRA" in plugin.installed()["fold_norms"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert any("4 decoder norm(s) not folded: LoRA" in r.getMessage() for r in PLUGIN_LOG.records)


# ----------------------------------------------------------------------------- written later


def test_reload_weights_folds_the_new_weights_again(plugin, compile_ranges, monkeypatch) -> None:
    """Compiled (the graph keeps the fold for good), then reloaded in checkpoint format (a layerwise reload
    through model.load_weights) and in kernel format (param.copy_ per name)."""
    import vllm.model_executor.model_loader.reload.inplace as inplace
    from vllm.config import set_current_vllm_config

    config = compile_ranges(fold_tests._entries(True))
    names, xs = _names(config), _xs(3, 7)
    state = _weights(3, names)
    model = _loaded(plugin, monkeypatch, config, state)
    assert vllm_load.FOLDS == {"rms_norm folded": 4} and "inplace.reload_weights" in vllm_load.FOLD_REPORT["refold"]
    engine = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None, dtype=torch.bfloat16),
                                   load_config=None, lora_config=None)
    with set_current_vllm_config(config):
        first = {m: model(x) for m, x in xs.items()}
    _assert_close(first, _plain(config, state, xs), state, xs)
    for seed, checkpoint in ((4, True), (5, False)):
        new = _weights(seed, names)
        compile_ranges_tables(config)
        refold.REFOLDS.clear()
        with torch.no_grad():  # the kernel format copies into the parameters (the norms' require grad here)
            inplace.reload_weights(engine, model, weights_iterator=iter(list(new.items())), weights_path=None,
                                   is_checkpoint_format=checkpoint)
        assert refold.REFOLDS == {"rms_norm folded again": 4}, (checkpoint, refold.REFOLDS)
        with set_current_vllm_config(config):
            got = {m: model(x) for m, x in xs.items()}
        _assert_close(got, _plain(config, new, xs), new, xs)


def compile_ranges_tables(config) -> None:
    """Load again the table the ``compile_ranges`` fixture named (``_plain`` unloads it)."""
    import os

    from tunekit import ops

    ops.load_tables(os.environ["TUNEKIT_TABLE"])


def _stub_worker(monkeypatch, model: nn.Module) -> tuple[object, dict]:
    """vLLM's GPU Worker with the bodies of its weight-update and sleep methods stubbed (see the module
    docstring), the plugin's hooks installed on them; returns a worker and the sleep state."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    slept: dict = {}

    def sleep(self, level: int = 1) -> None:
        params = dict(model.named_parameters())
        slept["level"], slept["saved"] = level, {k: p.detach().clone() for k, p in params.items()} if level == 1 else {}
        for p in params.values():
            p.data.zero_()  # the device memory is released (level 1: offloaded first)

    def wake_up(self, tags=None) -> None:
        for k, p in model.named_parameters():
            if k in slept["saved"]:
                p.data.copy_(slept["saved"][k])

    for name, fn in (("_start_weight_update", lambda self, is_draft=False: None),
                     ("finish_weight_update", lambda self: None), ("sleep", sleep), ("wake_up", wake_up)):
        monkeypatch.setattr(gpu_worker.Worker, name, fn)
    assert {"Worker weight updates", "Worker sleep/wake_up"} <= set(refold.install())
    return object.__new__(gpu_worker.Worker), slept


def test_a_weight_update_session_and_per_parameter_calls_fold_again(plugin, compile_ranges, monkeypatch) -> None:
    from vllm.config import set_current_vllm_config

    config = _eager(compile_ranges(fold_tests._entries(False)))
    names, xs = _names(config), _xs(1, 3)
    model = _loaded(plugin, monkeypatch, config, _weights(6, names))
    worker, _ = _stub_worker(monkeypatch, model)
    new = _weights(7, names)
    consumers = [k for k in new if "qkv_proj" in k or "gate_up" in k]
    # an RL refit: chunks through model.load_weights inside a session; folded once, at its end
    worker._start_weight_update()
    model.load_weights([(k, new[k]) for k in consumers])
    assert refold.REFOLDS == {} and torch.equal(model.layers[0].mlp.gate_up_proj.weight,
                                                new["layers.0.mlp.gate_up_proj.weight"])  # raw, mid-session
    model.load_weights([(k, v) for k, v in new.items() if k not in consumers])
    assert refold.REFOLDS == {}
    worker.finish_weight_update()
    assert refold.REFOLDS == {"rms_norm folded again": 4}
    with set_current_vllm_config(config):
        got = {m: model(x) for m, x in xs.items()}
    _assert_close(got, _plain(config, new, xs), new, xs)
    # an older RL framework: one load_weights call per parameter, the consumers before their norms
    compile_ranges_tables(config)
    newer = _weights(8, names)
    refold.REFOLDS.clear()
    for name, value in newer.items():
        model.load_weights([(name, value)])
    assert refold.REFOLDS == {"rms_norm folded again": 4, "rms_norm folded again (partly rescaled)": 4}
    with set_current_vllm_config(config):
        got = {m: model(x) for m, x in xs.items()}
    _assert_close(got, _plain(config, newer, xs), newer, xs)


def test_sleep_and_wake_up_keep_the_fold(plugin, compile_ranges, monkeypatch) -> None:
    import vllm.model_executor.model_loader.reload.inplace as inplace
    from vllm.config import set_current_vllm_config

    config = _eager(compile_ranges(fold_tests._entries(False)))
    names, xs = _names(config), _xs(3)
    state = _weights(9, names)
    model = _loaded(plugin, monkeypatch, config, state)
    worker, slept = _stub_worker(monkeypatch, model)
    with set_current_vllm_config(config):
        before = {m: model(x) for m, x in xs.items()}
    folded = {k: v.clone() for k, v in model.state_dict().items()}
    # level 1: the same bytes come back; nothing to fold again
    worker.sleep(1)
    worker.wake_up()
    assert refold.REFOLDS == {} and all(torch.equal(v, folded[k]) for k, v in model.state_dict().items())
    # level 2: the weights are gone; the wake-up leaves them to the reload that follows, which folds them
    worker.sleep(2)
    worker.wake_up(["weights"])
    assert refold.REFOLDS == {} and slept["level"] == 2
    assert any("woken from sleep level 2" in r.getMessage() for r in PLUGIN_LOG.records)
    engine = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization=None, dtype=torch.bfloat16),
                                   load_config=None, lora_config=None)
    inplace.reload_weights(engine, model, weights_iterator=iter(list(state.items())), weights_path=None,
                           is_checkpoint_format=True)
    assert refold.REFOLDS == {"rms_norm folded again": 4}
    assert all(torch.equal(v, folded[k]) for k, v in model.state_dict().items())  # the same fold, bit for bit
    with set_current_vllm_config(config):
        after = {m: model(x) for m, x in xs.items()}
    assert all(torch.equal(after[m], before[m]) for m in xs)


def test_the_switch_turns_the_fold_off(plugin, compile_ranges, monkeypatch) -> None:
    config = _eager(compile_ranges(fold_tests._entries(True)))
    state = _weights(10, _names(config))
    digest = vllm_compile.tables_digest()
    monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "0")
    done, why = vllm_load.install_fold()
    assert not done and why.startswith("TUNEKIT_FOLD_NORMS=0")
    assert vllm_compile.tables_digest() != digest  # another graph: never one traced folded
    model = _loaded(plugin, monkeypatch, config, state)  # the load hook the merge step shares
    assert vllm_load.FOLDS == {} and vllm_load.FOLD_REPORT["folded"] == 0
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(getattr(m, marks.FOLDED, False) for m in model.modules())
