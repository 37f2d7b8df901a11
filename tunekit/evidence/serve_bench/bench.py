"""The parent of ``tunekit serve-bench``: arm schedule, environment per arm, running and resuming, the report.

Call protocol::

    settings = build_settings(model="qwen3.5-27b", tables=["runs/x/table.json"], batches=[1, 2, 4, 8])
    serve = run_offline(settings, Path("runs/serve-qwen3.5-27b"), log=print)   # -> serve.json, .md, .png
    serve = report_dir(Path("runs/serve-qwen3.5-27b"))                         # --report-only: from the files

(``build_settings``: ``tunekit.evidence.serve_bench.settings``.)

Every arm runs in its own process (``tunekit.evidence.serve_bench.runner``; ``TUNEKIT_SERVE_RUNNER``
replaces its command, for tests), rounds alternate the arms (vanilla,
passthrough, tuned, vanilla, ...), and each process writes
``DIR/runs/{arm}-{i}.json``. Rerunning the same command in the same folder
resumes: finished processes are kept, settings must be the same. The report
(``serve.json``, ``serve.md``, ``serve.png``) is built from the files of the
folder alone, ``runs/`` and ``dispatch/``: ``serve.json`` names the run files
it was made from and holds the analysis, never copies of them.

Environment of an arm (on top of the caller's):

* ``VLLM_PLUGINS``: vLLM's allow-list of plugins (comma-separated names;
  unset = load all, empty = load none; applied to every ``vllm.*`` plugin
  group). vanilla: every entry-point name the runner's Python sees (or the
  caller's own ``VLLM_PLUGINS``) except ``tunekit``; passthrough and tuned:
  the same names plus ``tunekit``;
* ``TUNEKIT_TABLE``: the tables joined with ``os.pathsep`` in the tuned arm
  only (``tunekit.ops.load_tables`` splits it; the first table wins a key);
* ``TUNEKIT_DISPATCH_LOG=DIR/dispatch/{arm}-{i}-{pid}.json`` (``{pid}`` is
  expanded by ``tunekit.ops.write_dispatch_log``);
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in the runner's
  process: plugin state and dispatch markers readable there),
  ``VLLM_USE_FLASHINFER_SAMPLER=0`` when flashinfer is not importable,
  ``HF_HUB_OFFLINE=1``, ``VLLM_NO_USAGE_STATS=1``; ``TRITON_INTERPRET`` is
  removed (interpreted kernels would take the vendor path on a GPU);
* ``PYTHONPATH`` starts with this tunekit's folder, so the runner and the
  plugin load this code.

Every process after vanilla #0 gets vanilla #0's greedy tokens in its spec
(``forced``): the contexts of the teacher-forced agreement check.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tunekit.errors import Interrupted, UserError
from tunekit.evidence.serve_bench import ARMS, TABLE_ARMS, endpoint, spec_decode
from tunekit.evidence.serve_bench.agreement import DEFAULT_TOL
from tunekit.evidence.serve_bench.analysis import (
    RUNS_DIR,
    dispatch_logs,
    load_json,
    load_runs,
    merge_dispatch,
    run_file,
    summarize,
)
from tunekit.evidence.serve_bench.provenance import git_commit, package_root
from tunekit.evidence.serve_bench.runner import PROBE_FORMAT, PROGRESS
from tunekit.evidence.serve_bench.settings import Settings, vocab_size, write_model_dir

#: Replaces the runner command (shlex-split; it gets ``--probe ...`` or ``--spec F --out F``).
RUNNER_ENV = "TUNEKIT_SERVE_RUNNER"
#: The plugin's entry-point name in ``vllm.general_plugins`` (pyproject.toml).
PLUGIN_NAME = "tunekit"
GENERAL_GROUP = "vllm.general_plugins"
#: Groups vLLM loads only when VLLM_PLUGINS names them (0.33: endpoint plugins, HTTP routes of the API
#: server); listing every name of these would switch them on where an unset VLLM_PLUGINS leaves them off.
OPT_IN_GROUPS = ("vllm.endpoint_plugins",)
SETTINGS_FILE = "serve-settings.json"
INSTALL_HINT = ("install vLLM in its own virtualenv (python -m venv ~/.cache/tunekit/vllm-venv && "
                "~/.cache/tunekit/vllm-venv/bin/pip install vllm; scripts/setup.sh makes one) and pass "
                "--python ~/.cache/tunekit/vllm-venv/bin/python, or put a vLLM site folder on PYTHONPATH "
                "(README, 'Serving a table')")
PLUGIN_HINT = ("make the entry point visible there: pip install -e . in that Python, or a minimal "
               "tunekit-0.1.0.dist-info with entry_points.txt in its site folder (README, 'Serving a table')")


# ---------------------------------------------------------------------------
# Arms: order and environment
# ---------------------------------------------------------------------------


def schedule(arms: Sequence[str], processes: int) -> list[tuple[str, int]]:
    """(arm, process index) in run order: every round runs each arm once, in ``ARMS`` order."""
    order = [a for a in ARMS if a in arms]
    return [(arm, i) for i in range(processes) for arm in order]


def plugin_allow_lists(entry_points: dict[str, list[str]], user_value: str | None) -> tuple[str, str]:
    """(``VLLM_PLUGINS`` without tunekit, with tunekit). vLLM splits the value on commas and loads a
    plugin of any ``vllm.*`` group whose name is listed; an empty value loads none. The names are the
    caller's own list when ``VLLM_PLUGINS`` is set, else every entry point of those groups that an
    unset ``VLLM_PLUGINS`` loads (not the opt-in groups)."""
    if user_value is None:
        names = sorted({n for g, group in entry_points.items() if g not in OPT_IN_GROUPS for n in group})
    else:
        names = [n.strip() for n in user_value.split(",") if n.strip()]
    without = [n for n in names if n != PLUGIN_NAME]
    return ",".join(without), ",".join(without + [PLUGIN_NAME])


def arm_env(arm: str, index: int, base: dict[str, str], settings: Settings, probe: dict[str, Any],
            out_dir: Path) -> dict[str, str]:
    """The environment of process ``index`` of ``arm`` (module docstring)."""
    env = dict(base)
    without, with_plugin = plugin_allow_lists(probe.get("entry_points", {}), base.get("VLLM_PLUGINS"))
    env["VLLM_PLUGINS"] = without if arm == "vanilla" else with_plugin
    env.pop("TUNEKIT_TABLE", None)
    env.pop("TUNEKIT_FOLD_NORMS", None)
    if arm in TABLE_ARMS:
        env["TUNEKIT_TABLE"] = os.pathsep.join(settings.tables)
    if arm == "tuned":
        # the plugin folds by default: the tuned arm is the table with the fold off, the folded arm the default
        env["TUNEKIT_FOLD_NORMS"] = "0"
    env["TUNEKIT_DISPATCH_LOG"] = str(Path(out_dir).resolve() / "dispatch" / f"{arm}-{index}-{{pid}}.json")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not probe.get("flashinfer"):
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # the default top-k/top-p sampler imports flashinfer
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("TRITON_INTERPRET", None)
    root = package_root()
    rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


def runner_command(python: str) -> list[str]:
    override = os.environ.get(RUNNER_ENV)
    return shlex.split(override) if override else [python, "-m", "tunekit.evidence.serve_bench.runner"]


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def probe(settings: Settings, base_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Ask the runner's Python what it can run; UserError if it has no vLLM or cannot load the plugin."""
    env = dict(base_env if base_env is not None else os.environ)
    root = package_root()
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.pop("TRITON_INTERPRET", None)
    cmd = runner_command(settings.python) + ["--probe", *[a for t in settings.tables for a in ("--table", t)]]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise UserError(f"cannot run {cmd[0]}: no such interpreter") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{shlex.join(cmd)}: no answer in 300 s") from None
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    try:
        doc = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        doc = None
    if res.returncode != 0 or not isinstance(doc, dict) or doc.get("format") != PROBE_FORMAT:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"{shlex.join(cmd)} failed (rc {res.returncode}): {tail[0]}")
    python = doc.get("python", settings.python)
    if not doc.get("vllm"):
        raise UserError(f"vLLM is not importable by {python}: {INSTALL_HINT}")
    general = doc.get("entry_points", {}).get(GENERAL_GROUP, [])
    if any(a != "vanilla" for a in settings.arms) and PLUGIN_NAME not in general:
        raise UserError(f"{python} does not see tunekit's vLLM plugin (entry point {PLUGIN_NAME!r} of "
                        f"{GENERAL_GROUP}): {PLUGIN_HINT}")
    return doc


def _run_process(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float,
                 echo: Callable[[str], None]) -> int:
    """Run one runner; every line goes to ``log_path``, progress lines also to ``echo``. Killed (its
    whole process group, which it leads) past ``timeout``: returns -9 then."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(PROGRESS):
                    echo("  " + line[len(PROGRESS):].strip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM from a timeout): an orphaned engine would hold the GPU's
            # memory and make the next run's engine fail
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        reader.join(timeout=10)
    return rc


def _check_resume(out_dir: Path, settings: Settings) -> None:
    path = out_dir / SETTINGS_FILE
    if path.is_file():
        old = load_json(path, "serve-bench settings")
        if old != settings.key():
            changed = sorted(k for k in set(old) | set(settings.key()) if old.get(k) != settings.key().get(k))
            raise UserError(f"{out_dir} holds a serve-bench run with other settings ({', '.join(changed)}): "
                            "use another --out, or the same options to resume")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings.key(), indent=1) + "\n")


def _sigterm(signum: int, frame: Any) -> None:
    # as the CLI's SIGINT (a timeout's SIGTERM): unwinds through _run_process, which kills the engine
    raise Interrupted()


def run_offline(settings: Settings, out_dir: Path, log: Callable[[str], None] = print,
                base_env: dict[str, str] | None = None, stop_after_s: float | None = None) -> dict[str, Any] | None:
    """Probe, run every (arm, process) not finished yet, then write the report; returns ``serve.json``.

    ``stop_after_s``: start no further process once the next one (as long as the longest so far)
    would end past this many seconds after the first started; returns None then (a rerun resumes).
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return _run_offline(settings, Path(out_dir), log, base_env, stop_after_s)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_offline(settings: Settings, out_dir: Path, log: Callable[[str], None], base_env: dict[str, str] | None,
                 stop_after_s: float | None) -> dict[str, Any] | None:
    base = dict(base_env if base_env is not None else os.environ)
    info = probe(settings, base)
    mismatch = {p: d for p, d in info.get("table_mismatch", {}).items() if d}
    for path, diffs in mismatch.items():
        log(f"warning: {path} was tuned for another environment; the tuned arm will serve none of its "
            f"entries: {'; '.join(diffs)}")
    if info.get("device_error"):
        log(f"warning: {settings.python} could not describe its device: {info['device_error']}")
    _check_resume(out_dir, settings)
    model_dir = write_model_dir(out_dir, settings.model_config)
    runs_dir = out_dir / RUNS_DIR
    runs_dir.mkdir(exist_ok=True)
    order = schedule(settings.arms, settings.processes)
    log(f"serve-bench {settings.model}: {len(order)} processes ({', '.join(settings.arms)} x "
        f"{settings.processes}), batches {','.join(map(str, settings.batches))}, {settings.tokens} tokens, "
        + (f"speculative {settings.speculative} ({settings.prompts} prompts), " if settings.speculative else "")
        + (f"first token at prompts of {','.join(map(str, settings.first_token))} x "
           f"{settings.first_token_repeats}, " if settings.first_token else "")
        + f"vLLM {info['vllm']} ({info.get('python')})")
    started = time.perf_counter()
    longest = 0.0
    for n, (arm, i) in enumerate(order, 1):
        out = runs_dir / run_file(arm, i)
        if out.is_file():
            try:
                done = json.loads(out.read_text())
            except json.JSONDecodeError:
                done = {}
            if not done.get("error") and done.get("batches"):
                log(f"[{n}/{len(order)}] {arm} #{i}: finished earlier, kept ({out})")
                continue
        elapsed = time.perf_counter() - started
        if stop_after_s is not None and (elapsed >= stop_after_s or elapsed + longest > stop_after_s):
            left = len(order) - n + 1
            log(f"stopped after {elapsed:.0f} s (--stop-after {stop_after_s:.0f}): {left} of {len(order)} "
                "processes left; rerun the same command to resume")
            return None
        spec = {"arm": arm, "index": i, "engine": settings.engine(model_dir.resolve()),
                "batches": list(settings.batches), "tokens": settings.tokens, "prompt_len": settings.prompt_len,
                "repeats": settings.repeats, "agree_steps": settings.agree_steps, "logprobs": settings.logprobs,
                "vocab_size": vocab_size(settings.model_config), "profile_steps": settings.profile_steps,
                "weights": settings.weights, "weights_seed": settings.weights_seed, "prompts": settings.prompts,
                "first_token": list(settings.first_token), "first_token_repeats": settings.first_token_repeats,
                "forced": None if (arm, i) == ("vanilla", 0) else forced_tokens(runs_dir)}
        spec_path = runs_dir / f"{arm}-{i}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1) + "\n")
        env = arm_env(arm, i, base, settings, info, out_dir)
        cmd = runner_command(settings.python) + ["--spec", str(spec_path), "--out", str(out)]
        log(f"[{n}/{len(order)}] {arm} #{i}: VLLM_PLUGINS={env['VLLM_PLUGINS']!r}"
            + (f" TUNEKIT_TABLE={env['TUNEKIT_TABLE']}" if "TUNEKIT_TABLE" in env else "")
            + f" ({time.perf_counter() - started:.0f} s so far)")
        log_path = out_dir / "logs" / f"{arm}-{i}.log"
        t0 = time.perf_counter()
        rc = _run_process(cmd, env, log_path, settings.runner_timeout_s, log)
        longest = max(longest, time.perf_counter() - t0)
        result = json.loads(out.read_text()) if out.is_file() else {}
        if rc != 0 or result.get("error") or not result.get("batches"):
            why = result.get("error") or (f"killed after {settings.runner_timeout_s:.0f} s" if rc == -9
                                          else f"exit status {rc}, no result")
            raise UserError(f"{arm} #{i} failed: {why} (log: {log_path}); finished processes are kept, "
                            "rerun the same command to resume")
    return report_dir(out_dir, settings.logprob_tol, log, table_mismatch=mismatch)


def run_speculative(settings: Sequence[Settings], out_dir: Path, log: Callable[[str], None] = print,
                    base_env: dict[str, str] | None = None,
                    stop_after_s: float | None = None) -> dict[str, Any] | None:
    """One offline run per speculative setting (``--speculative ngram:3,ngram:5``), each a whole serve-bench
    folder ``DIR/<method>-<k>`` (every arm at that k: tuned is compared with vanilla at the same k), then
    ``DIR/serve.json`` and ``serve.md``: the settings side by side (``spec_index``). None when stopped early."""
    out_dir = Path(out_dir)
    started = time.perf_counter()
    for s in settings:
        if s.speculative is None:
            raise UserError("run_speculative takes settings with a speculative value each")
        left = None if stop_after_s is None else stop_after_s - (time.perf_counter() - started)
        log(f"serve-bench: speculative {s.speculative} in {out_dir / spec_decode.folder(s.speculative)}")
        if run_offline(s, out_dir / spec_decode.folder(s.speculative), log, base_env, left) is None:
            return None
    return spec_index(out_dir, log)


def spec_index(out_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """``DIR/serve.json`` (mode ``speculative``) and ``serve.md`` from the speculative settings' folders'
    ``serve.json``: per setting and batch size, TPOT per arm, tuned over vanilla, acceptance and mean M."""
    from tunekit.evidence.serve_bench.report import write_spec_index

    variants = []
    for sub in sorted(p for p in Path(out_dir).iterdir() if (p / SETTINGS_FILE).is_file()):
        key = load_json(sub / SETTINGS_FILE, "serve-bench settings")
        if not key.get("speculative") or not (sub / "serve.json").is_file():
            continue
        serve = load_json(sub / "serve.json", "serve-bench report")
        variants.append({"speculative": key["speculative"], "folder": sub.name,
                         "rows": [{"batch": r["batch"], "tpot": {a: (t or {}).get("median_ms") for a, t in
                                                                 r["tpot"].items()},
                                   "speedup": r.get("speedup"), "spec_decode": r.get("spec_decode")}
                                  for r in serve["batches"]], "notes": serve.get("notes", [])})
    if not variants:
        raise UserError(f"{out_dir} holds no finished speculative run (a <method>-<k> folder with serve.json)")
    variants.sort(key=lambda v: spec_decode.parse_one(v["speculative"]))
    doc = {"format": "tunekit.evidence.serve_bench.speculative/1", "mode": "speculative", "variants": variants}
    path, md = write_spec_index(doc, Path(out_dir))
    log(f"wrote {path}, {md}")
    return doc


def forced_tokens(runs_dir: Path) -> dict[str, list[list[int]]] | None:
    """Vanilla #0's teacher-forced tokens per batch size (``{"1": [[ids of request 0]], ...}``) from its result
    in ``runs_dir``: every later process decodes these contexts (``tunekit.evidence.serve_bench.forced``).
    None while there is none (the processes then force their own tokens, and the report compares none)."""
    path = Path(runs_dir) / run_file("vanilla", 0)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    out = {str(row["batch"]): [req["forced"] for req in row["forced"]["requests"]]
           for row in doc.get("batches", []) if (row.get("forced") or {}).get("requests")}
    return out or None


def report_dir(out_dir: Path, tol: float = DEFAULT_TOL, log: Callable[[str], None] = print,
               table_mismatch: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Build ``serve.json``, ``serve.md`` and ``serve.png`` from the files in ``out_dir`` (also alone:
    ``tunekit serve-bench --report-only``): the settings, the runner results in ``runs/`` and the dispatch
    logs; an ``--endpoint`` folder's report gets the servers' coverage (``endpoint.add_coverage``)."""
    from tunekit import table as table_mod
    from tunekit.evidence.serve_bench.report import write_reports
    from tunekit.problems.models.spec import ModelSpec

    out_dir = Path(out_dir)
    subs = [p for p in out_dir.iterdir() if (p / SETTINGS_FILE).is_file()] if out_dir.is_dir() else []
    if not (out_dir / SETTINGS_FILE).is_file() and subs:  # a --speculative run: one folder per setting
        for sub in sorted(subs):
            report_dir(sub, tol, log)
        return spec_index(out_dir, log)
    if not (out_dir / SETTINGS_FILE).is_file() and (out_dir / "serve.json").is_file():
        if load_json(out_dir / "serve.json", "serve-bench report").get("mode") == "endpoint":
            return endpoint.add_coverage(out_dir, log)
    key = load_json(out_dir / SETTINGS_FILE, "serve-bench settings")
    results = {arm: docs for arm, docs in load_runs(out_dir / RUNS_DIR).items() if arm in key["arms"]}
    if not results:
        raise UserError(f"{out_dir}/{RUNS_DIR} holds no finished runner result")
    coverage = {arm: merge_dispatch(logs) for arm in (*TABLE_ARMS, "passthrough") if arm in results
                for logs in [dispatch_logs(out_dir / "dispatch", arm, results[arm])] if logs}
    config = key["model_config"]
    spec = ModelSpec.from_config(config, name=key["model"], origin=str(out_dir / "model" / "config.json"))
    tables = [(p, table_mod.load(p)) for p in key["tables"]]
    if table_mismatch is None:
        table_mismatch = _mismatch_from_logs(coverage.get("tuned"))
    settings = {k: v for k, v in key.items() if k != "model_config"}
    settings["processes"] = max(len(docs) for docs in results.values())  # not in the key: a resume may add some
    serve = summarize(settings, results, coverage, spec, tables, table_mismatch, tol, git_commit())
    doc, md, png = write_reports(serve, out_dir)
    for row in serve["batches"]:
        log(_line(row))
    for note in serve["notes"]:
        log(f"note: {note}")
    log(f"wrote {doc}, {md}" + (f", {png}" if png else ""))
    return serve


def _mismatch_from_logs(coverage: dict[str, Any] | None) -> dict[str, list[str]]:
    """Without a probe (``--report-only``): a table the tuned arm's ops found mismatched, from its logs."""
    out: dict[str, list[str]] = {}
    for tables in (coverage or {}).get("tables", []):
        for t in tables or []:
            verdicts = t.get("devices") or {}
            if verdicts and all(v == "env_mismatch" for v in verdicts.values()):
                out[t["path"]] = ["env_mismatch in the tuned arm's dispatch log"]
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(row: dict[str, Any]) -> str:
    parts = [f"B={row['batch']}"]
    for arm in ARMS:
        tp = row["tpot"].get(arm)
        if tp:
            parts.append(f"{arm} {tp['median_ms']:.3f} ms ({tp['min_ms']:.3f}-{tp['max_ms']:.3f})")
    if row["speedup"] is not None:
        parts.append(f"speedup x{row['speedup']:.4f} ({_fmt(row['speedup_min'], '.4f')}-"
                     f"{_fmt(row['speedup_max'], '.4f')})")
    if row.get("folded_speedup") is not None:
        parts.append(f"folded x{row['folded_speedup']:.4f} ({_fmt(row['folded_speedup_min'], '.4f')}-"
                     f"{_fmt(row['folded_speedup_max'], '.4f')})")
    if row.get("passthrough_ratio") is not None:  # vanilla / passthrough TPOT: the plugin's cost alone
        parts.append(f"passthrough x{row['passthrough_ratio']:.4f}")
    if row["predicted_speedup"] is not None:
        parts.append(f"predicted x{row['predicted_speedup']:.4f}")
    if row["measured_saving_ms"] is not None and row["predicted_saving_ms"] is not None:
        parts.append(f"saving {row['measured_saving_ms']:.3f} ms (predicted {row['predicted_saving_ms']:.3f})")
    parts.append(f"agreement {row['agreement']['verdict']}")
    return "  ".join(parts)
