"""Hostile tables: documents mutated from valid ones either load and serve right, or are refused with one line.

A property-based test (Hypothesis) mutates a valid table, stamped for this
machine, in the ways a damaged, hand-edited or foreign table is wrong: huge
or non-positive M, N, K; params at and past the edge of the kernel's own
predicate (``Backend.invalid_reason``), of other types, missing or unknown;
NaN, infinities and negative figures; unknown ops and backends; duplicate
entries; missing keys; the stamp of another environment. For each document:

* ``tunekit.table.load`` either returns it or raises ``TableError`` (the
  CLI's one-line user error) whose message is one line; anything else fails;
* for a loaded one, every entry's serving decision is made
  (``tunekit.dispatch.decisions.resolve``, with the Triton build replaced by a
  stub so that no kernel is compiled) and no entry is served tuned with params
  its kernel's predicate rejects, at the entry's M or at the call's;
* one loaded document in :data:`SERVE_EVERY` is served for real (Triton's
  kernels under the interpreter): each small entry's op is called and its
  output checked against the fp64 reference under the search's bound.

Also: a 100,000-entry table loads and serves its first call within a stated
time (docs/serving.md).
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunekit import backends as registry
from tunekit import ops
from tunekit import table as table_mod
from tunekit.backends.triton import TritonBackend
from tunekit.dispatch import canary, decisions
from tunekit.errors import UserError
from tunekit.measure.device import detect
from tunekit.problems import opspec
from tunekit.problems.shapes import Problem

pytestmark = [pytest.mark.usefixtures("clean_ops"), pytest.mark.faults]

DOCUMENTS = 10_000
#: one loaded document in this many is served for real (kernels built and run under the interpreter)
SERVE_EVERY = 500
CPU = torch.device("cpu")

#: (op, m, n, k) of the valid base table: small enough to serve under the interpreter
SHAPES = [("gemv", 1, 16, 64), ("gemv", 4, 16, 64), ("gemv", 2, 24, 128), ("rms_gemv", 1, 16, 64),
          ("gemv_add", 1, 8, 64), ("rms_norm", 1, 64, 64), ("silu_and_mul", 2, 32, 64)]


def _base() -> dict:
    """A valid table stamped for this machine, one entry per :data:`SHAPES` at the Triton default config."""
    triton = registry.get("triton")
    rows = []
    for op, m, n, k in SHAPES:
        params = triton.space(Problem(op, "bf16", m, n, k)).default
        rows.append({"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": "triton", "params": params,
                     "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0})
    return table_mod.as_json(table_mod.build_table(rows, detect().as_dict(), {}, 0.0, ["triton"]))


BASE = _base()
BASE_TEXT = json.dumps(BASE)
HOSTILE_NUMBERS = [0, -1, 1, 3, 2**31, 2**63, 10**30, 1.5, float("nan"), float("inf"), -float("inf"), "1", None,
                   True, [], {}]
HOSTILE_PARAMS = [0, -1, 3, 5, 255, 256, 1 << 20, -(1 << 20), 1.0, 2.5, float("nan"), "4", "", "dot_w", "nope",
                  True, False, None]
BACKENDS = ["nonesuch", "vendor", "inductor", "hip", "no_such_module:X", "tunekit.table:FORMAT", "",
            "flashinfer", "vllm_skinny", "tunekit.backends.vendor:BACKEND"]
ENV_FIELDS = ["gpu", "arch", "runtime", "torch", "triton", "cu_count", "wave_size", "tunekit", "kernel_hash"]


def _domains(entry: dict) -> dict:
    try:
        return registry.get("triton").space(Problem(entry["op"], "bf16", 1, 16, 64)).domains
    except Exception:  # noqa: BLE001 - a mutated op: no domains to take edges from
        return {}


KINDS = ("field", "param_edge", "param_value", "param_drop", "param_unknown", "delete", "op", "backend",
         "duplicate", "huge", "env", "env_delete", "format", "top", "entries")
ENTRY_KINDS = KINDS[:10]


def mutate(doc: dict, seed: int) -> None:
    """Apply one hostile change to ``doc`` in place, chosen by ``seed`` (Hypothesis draws the seeds: drawing
    plain integers keeps ten thousand documents fast, and a failure still shrinks to the fewest, smallest)."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    entries = doc.get("entries")
    entry = None
    if isinstance(entries, list) and entries:
        entry = rng.choice(entries)
        if not isinstance(entry, dict):
            entry = None
    if kind in ENTRY_KINDS and entry is None:
        kind = "top"
    if kind == "field":
        name = rng.choice(["m", "n", "k", "time_us", "baseline_us", "speedup", "gbps", "pct_of_limit",
                           "max_abs_err", "err_ratio", "count", "dtype", "kernel", "timing_kind", "params"])
        entry[name] = rng.choice(HOSTILE_NUMBERS)
    elif kind in ("param_edge", "param_value", "param_drop", "param_unknown"):
        params = entry.get("params")
        if not isinstance(params, dict) or not params:
            entry["params"] = rng.choice(HOSTILE_PARAMS + [[1], {"a": 1}])
            return
        key = rng.choice(sorted(params))
        domain = _domains(entry).get(key, [])
        numbers = [v for v in domain if type(v) is int]
        if kind == "param_edge" and numbers:  # at and just past the domain's edges: the predicate decides
            lo, hi = min(numbers), max(numbers)
            params[key] = rng.choice(sorted({lo, hi, lo - 1, hi + 1, hi * 2, lo // 2, *numbers}))
        elif kind == "param_edge" and domain:
            params[key] = rng.choice(list(domain))
        elif kind in ("param_edge", "param_value"):
            params[key] = rng.choice(HOSTILE_PARAMS)
        elif kind == "param_drop":
            del params[key]
        else:
            params[rng.choice(["BLOCK_Q", "num_ctas", "maxnreg"])] = rng.choice([1, 4])
    elif kind == "delete":
        entry.pop(rng.choice(sorted(entry)), None)
    elif kind == "op":
        entry["op"] = rng.choice(["gemv", "rms_gemv", "gemv_add", "rms_norm", "silu_and_mul", "gated_rms_norm",
                                  "bias_gelu", "matmul", "", "GEMV"])
    elif kind == "backend":
        entry["backend"] = rng.choice(BACKENDS)
    elif kind == "duplicate":
        twin = copy.deepcopy(entry)
        if rng.random() < 0.5:
            twin["backend"] = rng.choice(BACKENDS)
        entries.append(twin)
    elif kind == "huge":
        entry[rng.choice(["n", "k", "m"])] = rng.choice([2**20, 2**31 - 1, 2**31, 2**40, 2**63, 10**40])
    elif kind == "env":
        env = doc.get("environment")
        if isinstance(env, dict):
            env[rng.choice(ENV_FIELDS)] = rng.choice(["NVIDIA H200", "sm_90", "gfx942", "2.0.0", None, 3, {},
                                                      {"triton": 1}, {"triton": "0" * 16}])
    elif kind == "env_delete":
        env = doc.get("environment")
        if isinstance(env, dict) and env:
            env.pop(rng.choice(sorted(env)))
    elif kind == "format":
        doc["format"] = rng.choice(["tunekit.dispatch/2", "", None, 1])
    elif kind == "top":
        doc[rng.choice(["read_limit_gbps", "min_gain", "environment", "entries", "tp"])] = rng.choice(HOSTILE_NUMBERS)
    elif kind == "entries":
        doc["entries"] = rng.choice([[], [1], ["x"], [None], {}])


NOT_TABLES = ([], "table", 1, None)


def document(seeds: list[int]) -> dict | list | str | int | None:
    """The base table with one mutation per seed; a first seed of 0 mod 97: not a table at all."""
    if seeds[0] % 97 == 0:
        return NOT_TABLES[seeds[0] % len(NOT_TABLES)]
    doc = json.loads(BASE_TEXT)
    for seed in seeds:
        mutate(doc, seed)
    return doc


def _served_tuned(entry: dict, m: int) -> decisions.Choice:
    return decisions.resolve(entry["op"], entry["dtype"], m, entry["n"], entry["k"], CPU, False)


def _predicate_rejects(entry: dict, m: int) -> str | None:
    """The kernel's own verdict (raw, not through the serving code): None accepts."""
    backend = registry.get(entry["backend"])
    try:
        return backend.invalid_reason(Problem(entry["op"], entry["dtype"], m, entry["n"], entry["k"]),
                                      entry["params"])
    except Exception as exc:  # noqa: BLE001 - choking on the params is a rejection
        return f"{type(exc).__name__}: {exc}"


#: op -> the op called the way serving calls it, on OpSpec.make_inputs' inputs
CALLS = {
    "gemv": lambda i: torch.ops.tunekit.gemv(i[0], i[1], None),
    "rms_gemv": lambda i: torch.ops.tunekit.rms_gemv(i[0], i[1], opspec.EPS),
    "gemv_add": lambda i: torch.ops.tunekit.gemv_add(i[0], i[1], i[2]),
    "rms_norm": lambda i: torch.ops.tunekit.rms_norm(i[0], i[1], opspec.EPS),
    "silu_and_mul": lambda i: torch.ops.tunekit.silu_and_mul(i[0]),
}


def _serve_for_real(path: Path, table: dict) -> int:
    """Load ``path`` as serving does and call every small entry's op: each output within the search's bound of
    its fp64 reference (tuned or fallback alike). Returns the calls made."""
    ops.load_tables(str(path))
    calls = 0
    for e in table["entries"]:
        if e["op"] not in CALLS or e["dtype"] != "bf16" or e["n"] > 256 or e["k"] > 256 or e["m"] > 8:
            continue
        problem = Problem(e["op"], "bf16", e["m"], e["n"], e["k"])
        spec = opspec.get(e["op"])
        inputs = spec.make_inputs(problem, CPU, torch.Generator().manual_seed(calls))
        out = CALLS[e["op"]](inputs)
        assert canary.mismatch(spec, problem, inputs, out) is None, e
        calls += 1
    return calls


def test_ten_thousand_hostile_documents_load_and_serve_right_or_are_refused_in_one_line(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    import fault_backend  # noqa: F401 - importable by name, as serving imports it

    path = tmp_path / "table.json"
    seen = {"documents": 0, "refused": 0, "loaded": 0, "tuned": 0, "rejected_not_served": 0, "served_calls": 0}
    real_build = TritonBackend.build

    def stub_build(self, problem, params, device):  # no compile: the decision is what is tested
        return lambda inputs, out, **kwargs: None

    @settings(max_examples=DOCUMENTS, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3))
    def check(seeds: list[int]) -> None:
        doc = document(seeds)
        seen["documents"] += 1
        text = json.dumps(doc, allow_nan=True)  # NaN and Infinity as Python's json writes and reads them
        try:
            # table_mod.load without the file: its read is the one step that is not the document's
            table = json.loads(text)
            table_mod.validate(table, source=str(path))
        except UserError as exc:
            message = str(exc)
            assert message and "\n" not in message and str(path) in message, message
            seen["refused"] += 1
            return
        seen["loaded"] += 1
        if seen["loaded"] % SERVE_EVERY == 1:  # through the file, the real loader and the real kernels
            path.write_text(text)
            monkeypatch.setattr(TritonBackend, "build", real_build)
            monkeypatch.setattr(table_mod, "load", real_load)
            seen["served_calls"] += _serve_for_real(path, table)
            monkeypatch.setattr(TritonBackend, "build", stub_build)
            monkeypatch.setattr(table_mod, "load", lambda p, strict=False: current[0])
        current[0] = table
        ops.load_tables(str(path))  # serving's own load path, fed the validated document
        for e in table["entries"]:
            for m in sorted({1, e["m"]}):
                choice = _served_tuned(e, m)
                rejected = None
                if choice.impl.startswith("tuned:"):
                    seen["tuned"] += 1
                    # the entry the lookup chose for M (this one, or a larger M's), as the document holds it
                    served = choice.entry.to_json()
                    rejected = _predicate_rejects(served, served["m"]) or _predicate_rejects(served, m)
                    assert rejected is None, (served, m, rejected)
                    assert table_mod.params_problem(
                        registry.get(served["backend"]), served["backend"],
                        Problem(served["op"], served["dtype"], served["m"], served["n"], served["k"]),
                        served["params"]) is None, served
                elif e["backend"] == "triton" and _predicate_rejects(e, e["m"]) is not None:
                    seen["rejected_not_served"] += 1

    real_load, current = table_mod.load, [None]
    monkeypatch.setattr(TritonBackend, "build", stub_build)
    monkeypatch.setattr(table_mod, "load", lambda p, strict=False: current[0])
    check()
    assert seen["documents"] >= DOCUMENTS, seen
    # the mutations reach every verdict: refused, loaded and served tuned, loaded with a rejected config kept out
    assert seen["refused"] > 1000 and seen["loaded"] > 1000 and seen["tuned"] > 1000, seen
    assert seen["rejected_not_served"] > 50 and seen["served_calls"] > 20, seen


# ----------------------------------------------------------------------------- a 100,000-entry table

#: CPU seconds to load a 100,000-entry table (39 MB) and serve its first call, measured on the development machine
#: (2 cores shared with other work): medians of 1.89 and 2.22 s since entries are typed, 1.50 and 1.64 s before in
#: the same runs (0.80-0.86 s when first measured, on a quieter machine); parsing the JSON ~0.42, checking the
#: entries ~0.32, the index ~0.19 (docs/serving.md states it); the test allows this multiple of it. The wall
#: clock there, a loaded machine's (load averages of 25 on the 2 cores were seen), stretched the same work to
#: 3-10 s: it is bounded loosely.
BIG_ENTRIES, BIG_MEASURED_CPU_S, BIG_MARGIN, BIG_WALL_S = 100_000, 2.2, 3, 24


def test_a_100000_entry_table_loads_and_serves_within_the_stated_time(tmp_path: Path) -> None:
    params = registry.get("triton").space(Problem("gemv", "bf16", 1, 16, 64)).default
    table = dict(BASE)
    table["entries"] = [
        {"op": "gemv", "dtype": "bf16", "m": (1, 2, 4, 8)[i % 4], "n": 16 + i // 4, "k": 64, "backend": "triton",
         "kernel": "gemv", "params": params, "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0,
         "pct_of_limit": None, "max_abs_err": 0.0, "err_ratio": 0.1, "count": 1, "timing_kind": "gpu"}
        for i in range(BIG_ENTRIES)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(table))
    x = torch.randn(1, 64).bfloat16()
    # a small GEMV keeps the interpreter's launch (one program per 4 rows) out of the figure
    w = torch.randn(16, 64).bfloat16()
    start, start_cpu = time.perf_counter(), time.process_time()
    loaded = ops.load_tables(str(path))
    y = torch.ops.tunekit.gemv(x, w, None)
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    assert loaded[0]["entries"] == BIG_ENTRIES and "error" not in loaded[0]
    assert ops.dispatch_stats()[0]["impl"] == "tuned:triton"
    assert canary.mismatch(opspec.get("gemv"), Problem("gemv", "bf16", 1, w.shape[0], 64), (x, w), y) is None
    assert cpu < BIG_MEASURED_CPU_S * BIG_MARGIN, f"{cpu:.2f} s of CPU"
    assert seconds < BIG_WALL_S, f"{seconds:.1f} s"
    # every key's lookup is one dict access and a bisection of its Ms: the last key costs what the first does
    index = ops.serving_table("cpu")
    assert index.size == BIG_ENTRIES and index.lookup("gemv", "bf16", 3, 16 + (BIG_ENTRIES - 1) // 4, 64).m == 4
