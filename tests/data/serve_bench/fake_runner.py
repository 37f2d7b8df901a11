"""A stand-in for ``python -m tunekit.evidence.serve_bench.runner`` in the tests: the real runner module, fed stub
``vllm`` and ``torch`` modules (no GPU, no vLLM, no torch import: fast).

The stub engine sleeps ``tokens x TPOT`` per generate, TPOT by arm as told by the environment the parent
set (vanilla 2.0 ms, passthrough 2.4 ms, tuned 1.6 ms; folded 1.5 ms, otherwise served as tuned), emulates
vLLM's VLLM_PLUGINS allow-list when it
"loads" the tunekit plugin (a stub plugin module and a stub ``tunekit.ops`` whose dispatch log is written
to TUNEKIT_DISPATCH_LOG), and returns deterministic greedy tokens and logprobs (tuned: 1e-3 nats off;
at B=2 request 1 flips to a near tie at step 5). With the runner's realistic-weights hook on the stub
dummy loader (``--weights realistic``; the recipe itself is stubbed: no torch here), the stub is a model
with peaked logits instead: each token follows from the one before, the top token at -0.12 nats, the
arms within 1e-3 nats of vanilla, no flip. Every call appends "arm index pid" to FAKE_RECORD.

Environment knobs: FAKE_PROBE (JSON merged into the probe answer), FAKE_TUNED_MISMATCH=1 (the tuned arm's
ops find the table tuned elsewhere: every call env_mismatch), FAKE_FAIL_ARM=ARM (that arm's engine raises),
FAKE_ENGINE_SLEEP (seconds the engine takes to start), FAKE_SLOW_ONE_TOKEN_MS (a 1-token generate takes that many
ms longer: the difference method's TPOT drops below the timestamps'), FAKE_PERTURB_ARM=ARM (realistic or a
checkpoint's weights: that arm's distributions are 0.05-0.2 nats off, as a wrong kernel would make them).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

TPOT_MS = {"vanilla": 2.0, "passthrough": 2.4, "tuned": 1.6, "folded": 1.5}
#: the stub engine's kernels per decode token, by arm: {category: (us, kernels)} (a prefill adds a fixed 50 us
#: and 10 kernels per category). tuned: the GEMMs moved to tunekit's GEMV, Inductor's norm kernels to tunekit's.
KERNELS = {"vanilla": {"vendor_gemm": (1500.0, 300), "inductor": (200.0, 120), "other": (100.0, 50)},
           "tuned": {"tunekit_gemv": (1150.0, 300), "tunekit_elementwise": (150.0, 120), "inductor": (20.0, 10),
                     "other": (100.0, 50)}}
KERNELS["passthrough"], KERNELS["folded"] = KERNELS["vanilla"], KERNELS["tuned"]


def _module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def _plugins_allowed(name: str) -> bool:
    # vLLM: unset -> every plugin; otherwise the comma-split list (an empty value matches nothing)
    value = os.environ.get("VLLM_PLUGINS")
    return value is None or name in value.split(",")


def _arm() -> str:
    if not _plugins_allowed("tunekit"):
        return "vanilla"
    if not os.environ.get("TUNEKIT_TABLE"):
        return "passthrough"
    return "tuned" if os.environ.get("TUNEKIT_FOLD_NORMS") == "0" else "folded"  # the plugin folds by default


class Logprob:
    def __init__(self, logprob: float, rank: int) -> None:
        self.logprob, self.rank = logprob, rank


class SamplingParams:
    def __init__(self, max_tokens: int = 16, temperature: float = 1.0, ignore_eos: bool = False,
                 detokenize: bool = True, logprobs: int | None = None) -> None:
        self.max_tokens, self.logprobs = max_tokens, logprobs


class _Completion:
    def __init__(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> None:
        self.token_ids, self.logprobs = token_ids, logprobs


class _Output:
    def __init__(self, completion: _Completion) -> None:
        self.outputs = [completion]
        self.metrics = None


def _routed_call() -> int:
    total = 0
    for i in range(2000):
        total += i
    return total


class _OutputProcessor:
    """vLLM v1's output processor, as far as the runner's token clock reads it: one call per engine step."""

    def process_outputs(self, outputs: list, engine_core_timestamp: float | None = None) -> None:
        return None


class DummyModelLoader:
    """vLLM's dummy loader, as far as the runner's realistic-weights hook reads it."""

    def load_weights(self, model: object, model_config: object) -> None:
        return None


class LLM:
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.llm_engine = types.SimpleNamespace(output_processor=_OutputProcessor())
        self.arm = _arm()
        self.batches_seen: set[int] = set()
        # speculative decoding (the spec's speculative_config): every decode step verifies k drafts per request, of
        # which the first k // 2 are accepted; the counters as LLM.get_metrics() gives them, the steps through the
        # in-process scheduler's schedule() as vLLM's engine core calls it
        spec = kwargs.get("speculative_config")
        self.k = int(spec["num_speculative_tokens"]) if isinstance(spec, dict) else 0
        self.metrics = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": [0] * self.k}
        self.llm_engine.engine_core = types.SimpleNamespace(
            engine_core=types.SimpleNamespace(scheduler=_Scheduler()))
        if os.environ.get("FAKE_FAIL_ARM") == self.arm:
            raise RuntimeError("CUDA out of memory (stub)")
        if _plugins_allowed("tunekit"):
            _load_stub_plugin(self)
        if kwargs.get("load_format") == "dummy":
            DummyModelLoader().load_weights(types.SimpleNamespace(), None)
        self.realistic = getattr(DummyModelLoader.load_weights, "_tunekit_realistic", False)
        if kwargs.get("load_format") == "auto":  # a checkpoint's own weights (--model-dir): peaked as realistic
            self.realistic = True
        time.sleep(float(os.environ.get("FAKE_ENGINE_SLEEP", "0.01")))

    def generate(self, prompts: list[dict], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[_Output]:
        self.batches_seen.add(len(prompts))
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        longest = max(sp.max_tokens for sp in per_request)
        LLM.last = (self.arm, longest)  # what a profile of this call would see
        self._decode(len(prompts), longest)
        if self.arm in ("tuned", "folded"):
            for _ in range(10):  # Python work per routed call, as a tuned prefill's ops do (cProfile sees it)
                _routed_call()
        if self.realistic:
            return [self._peaked(p["prompt_token_ids"], sp) for p, sp in zip(prompts, per_request, strict=True)]
        outs = []
        for r, (p, sp) in enumerate(zip(prompts, per_request, strict=True)):
            ids = p["prompt_token_ids"]
            tokens, lps = [], []
            for s in range(sp.max_tokens):
                tid = 100 + (sum(ids) + 31 * s + 7 * r) % 900
                alt = tid + 1
                lp = -12.42 + 0.001 * ((s + r) % 5)
                if self.arm in ("tuned", "folded"):
                    lp += 0.001
                    if len(prompts) == 2 and r == 1 and s == 5:  # a near tie flips
                        tid, alt = alt, tid
                tokens.append(tid)
                lps.append({tid: Logprob(lp, 1), alt: Logprob(lp - 0.002, 2), tid + 2: Logprob(lp - 0.5, 3)})
                if self.arm in ("tuned", "folded") and len(prompts) == 2 and r == 1 and s >= 5:
                    break  # a different token: the rest of the sequence is another text
            while len(tokens) < sp.max_tokens:
                tokens.append(999)
                lps.append({999: Logprob(-12.0, 1)})
            outs.append(_Output(_Completion(tokens, lps if sp.logprobs is not None else None)))
        return outs

    def get_metrics(self) -> list:
        if not self.k:
            raise AssertionError("Stat logging disabled")
        m, name = self.metrics, "vllm:spec_decode_num_"
        return [types.SimpleNamespace(name=name + "drafts", value=m["drafts"]),
                types.SimpleNamespace(name=name + "draft_tokens_total", value=m["draft_tokens"]),
                types.SimpleNamespace(name=name + "accepted_tokens", value=m["accepted_tokens"]),
                types.SimpleNamespace(name=name + "accepted_tokens_per_pos", values=list(m["per_pos"]))]

    def _peaked(self, ids: list[int], sp: SamplingParams) -> _Output:
        """Realistic weights: the next token a function of the last one, a peaked distribution over three."""
        lps = [-0.12, -2.5, -4.0]
        if self.arm in ("tuned", "folded", "passthrough"):
            lps = [lp + 0.001 for lp in lps]
        if os.environ.get("FAKE_PERTURB_ARM") == self.arm:
            lps = [-0.9, -1.2, -3.0]
        ctx, tokens, steps = list(ids), [], []
        for _ in range(sp.max_tokens):
            tid = 100 + (ctx[-1] * 31 + 7) % 900
            tokens.append(tid)
            alts = (tid, tid + 1, tid + 2)
            steps.append({t: Logprob(lp, k + 1) for k, (t, lp) in enumerate(zip(alts, lps, strict=True))})
            ctx.append(tid)
        return _Output(_Completion(tokens, steps if sp.logprobs is not None else None))

    def _decode(self, requests: int, tokens: int) -> None:
        """The stub engine's time: a prefill and the first token, then one step per further token, each step's new
        tokens handed to the output processor (FAKE_SLOW_ONE_TOKEN_MS: a 1-token generate takes that much longer)."""
        step = TPOT_MS[self.arm] / 1000.0
        slow = float(os.environ.get("FAKE_SLOW_ONE_TOKEN_MS", "0")) / 1000.0 if tokens == 1 else 0.0
        start = time.perf_counter() + 0.001 + slow
        scheduler = self.llm_engine.engine_core.engine_core.scheduler
        scheduler.schedule(requests, new=True)  # the prefill
        for s in range(tokens):
            if s and self.k:
                scheduler.schedule(requests * (1 + self.k))
                self.metrics["drafts"] += requests
                self.metrics["draft_tokens"] += requests * self.k
                self.metrics["accepted_tokens"] += requests * (self.k // 2)
                for pos in range(self.k // 2):
                    self.metrics["per_pos"][pos] += requests
            # to a deadline, not by steps: a sleep's overshoot on a loaded machine does not add up over the tokens
            time.sleep(max(0.0, start + (s + 1) * step - time.perf_counter()))
            self.llm_engine.output_processor.process_outputs(
                [types.SimpleNamespace(request_id=str(r), new_token_ids=[s]) for r in range(requests)])


class _Scheduler:
    """vLLM v1's scheduler, as far as serve-bench's step hook reads its output."""

    def schedule(self, tokens: int, new: bool = False) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_num_scheduled_tokens=tokens, scheduled_new_reqs=["r"] if new else [],
                                     scheduled_spec_decode_tokens={})


def _load_stub_plugin(llm: LLM) -> None:
    table = os.environ.get("TUNEKIT_TABLE", "")

    def dispatch_log() -> dict:
        calls = []
        mismatch = os.environ.get("FAKE_TUNED_MISMATCH") == "1"
        for m in sorted(llm.batches_seen):
            if not table:
                impl_gemv = impl_norm = "fallback:no_table"
            elif mismatch:
                impl_gemv = impl_norm = "fallback:env_mismatch"
            else:
                impl_gemv, impl_norm = "tuned:triton", "fallback:no_entry"
            calls.append({"op": "gemv", "dtype": "bf16", "shape": "96x5120", "m": m, "bias": False,
                          "impl": impl_gemv, "calls": 48, "counted_at": "capture"})
            calls.append({"op": "gemma_rms_norm", "dtype": "bf16", "shape": "5120", "m": m, "bias": False,
                          "impl": impl_norm, "calls": 1, "counted_at": "capture"})
            calls.append({"op": "gemv", "dtype": "bf16", "shape": "96x5120", "m": 16 * m, "bias": False,
                          "impl": "fallback:no_table" if not table else "fallback:m_above_table",
                          "calls": 48, "counted_at": "call"})
            if llm.k:  # the verify steps: each request's token and its k drafts; tables serve up to M = 8 here
                verify = m * (1 + llm.k)
                calls.append({"op": "gemv", "dtype": "bf16", "shape": "96x5120", "m": verify, "bias": False,
                              "impl": impl_gemv if verify <= 8 else "fallback:m_above_table", "calls": 48,
                              "counted_at": "capture"})
        tables = [{"path": p, "entries": 1} for p in table.split(os.pathsep) if p]
        return {"format": "tunekit.dispatch_stats/1", "pid": os.getpid(), "tables": tables, "note": "capture",
                "calls": calls}

    def write_dispatch_log() -> Path | None:
        target = os.environ.get("TUNEKIT_DISPATCH_LOG", "")
        if not target:
            return None
        out = Path(target.replace("{pid}", str(os.getpid())))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dispatch_log()))
        return out

    _module("tunekit.ops", dispatch_log=dispatch_log, write_dispatch_log=write_dispatch_log)
    _module("tunekit.integrations.vllm.plugin", installed=lambda: {"linear": "stub"}, skipped=lambda: {})


def _install_stubs() -> None:
    from dataclasses import dataclass

    @dataclass
    class EngineArgs:
        model: str = ""
        load_format: str = "auto"
        skip_tokenizer_init: bool = False
        dtype: str = "auto"
        max_model_len: int | None = None
        max_num_seqs: int | None = None
        gpu_memory_utilization: float = 0.9
        enforce_eager: bool = False
        seed: int = 0
        enable_prefix_caching: bool | None = None
        # no gdn_prefill_backend: an older vLLM, the runner must drop it

    cuda = types.SimpleNamespace(is_available=lambda: True, get_device_name=lambda *a: "Fake H200")
    _module("torch", __version__="0.0+fake", cuda=cuda)
    _module("vllm", __version__="0.0.fake", LLM=LLM, SamplingParams=SamplingParams)
    _module("vllm.inputs", TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids})
    _module("vllm.engine")
    _module("vllm.engine.arg_utils", EngineArgs=EngineArgs)
    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        _module(name)
    _module("vllm.model_executor.model_loader.dummy_loader", DummyModelLoader=DummyModelLoader)


def main() -> int:
    _install_stubs()
    from tunekit.evidence.serve_bench import runner

    def probe(tables: list[str]) -> dict:
        doc = {"format": runner.PROBE_FORMAT, "python": sys.executable, "vllm": "0.0.fake", "flashinfer": False,
               "entry_points": {"vllm.general_plugins": ["qwen35_text", "tunekit"]},
               "device": {"name": "Fake H200"}, "table_mismatch": {t: [] for t in tables}}
        doc.update(json.loads(os.environ.get("FAKE_PROBE", "{}")))
        return doc

    runner.probe = probe

    def profile_totals(run) -> dict:  # torch's profiler of the stub engine: its KERNELS for the tokens asked
        run()
        arm, tokens = LLM.last
        cats = {c: {"us": 50.0 + tokens * us, "kernels": 10 + tokens * k} for c, (us, k) in KERNELS[arm].items()}
        named = {f"{c}: {c}_kernel": v for c, v in cats.items()}  # one kernel name per category
        return cats, named, {f"{k} grid=(1,1,1) block=(64,1,1) after=-": v | {"gap_us": 0.0} for k, v in named.items()}

    def host_profile(run) -> dict:  # the stub engine's host ops: tuned spends 2 ms more in its ops
        run()
        arm, _ = LLM.last
        served = arm in ("tuned", "folded")
        return {"aten::mm": {"us": 500.0, "calls": 10},
                "tunekit::gemv": {"us": 2000.0 if served else 0.0, "calls": 10 if served else 0}}

    from tunekit.evidence.serve_bench import profile, weights
    weights.realistic_init_ = lambda model, seed=0, recipe=None: {"linear": 7, "norm": 3, "embedding": 1}
    profile.profile_totals = profile_totals
    profile.host_profile = host_profile
    if "--probe" not in sys.argv:
        spec = json.loads(Path(sys.argv[sys.argv.index("--spec") + 1]).read_text())
        with open(os.environ["FAKE_RECORD"], "a") as f:
            f.write(f"{spec['arm']} {spec['index']} {os.getpid()} {_arm()}\n")
    return runner.main(sys.argv[1:])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
