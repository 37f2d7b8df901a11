"""tunekit campaign: plan parsing and checks, a run inside a budget, the rerun that resumes, the state file,
the README, a failing step, and SIGTERM leaving a consistent state. Cheap steps only (``tunekit shapes``,
``tunekit models`` and small scripts), so the whole file runs in well under a minute on the CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tunekit.errors import UserError
from tunekit.evidence import campaign
from tunekit.evidence.campaign import plan as plan_mod

REPO = Path(__file__).resolve().parents[1]

#: A step script: writes DIR/started (its pid), sleeps, writes DIR/done, exits with the given status.
STEP_SCRIPT = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
(out / "started").write_text(str(os.getpid()))
time.sleep(float(sys.argv[2]))
(out / "done").write_text("1")
sys.exit(int(sys.argv[3]))
"""


def _load(path: Path) -> campaign.Plan:
    from tunekit.cli import app

    return campaign.load_plan(path, campaign.read_verbs(app))


def _write(tmp_path: Path, text: str, name: str = "plan.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "step.py"
    path.write_text(STEP_SCRIPT)
    return path


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", "campaign", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kw)


def _state(out: Path) -> dict:
    return json.loads((out / "campaign.json").read_text())


HEAD = '[campaign]\nname = "t"\nabout = "A test campaign."\n'


# -- the plan --------------------------------------------------------------------------------------------


def test_a_plan_renders_each_step_as_its_tunekit_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TUNEKIT_TEST_UNSET", raising=False)
    seed = tmp_path / "trials.csv"
    seed.write_text("x\n")
    env = 'env = { PYTHONPATH = "{repo}/x:${TUNEKIT_TEST_UNSET}:$HOME" }\n'
    path = _write(tmp_path, HEAD + env + f"""
[[step]]
name = "main"
verb = "search"
estimate_s = 200
min_s = 60
about = "the main table"
[step.options]
model = "qwen3.5-27b"
m = "1,2"
trials = 3
seed-from = ["{seed}", "{{repo}}/pyproject.toml"]
restrict = ["W_EVICT="]
progress = false

[[step]]
name = "chain"
verb = "chain"
estimate_s = 100
env = {{ TUNEKIT_X = "{{step}}/x" }}
[step.options]
model = "qwen3.5-27b"
table = ["{{out}}/main/table.json"]

[[step]]
name = "serve"
verb = "serve-bench"
estimate_s = 600
[step.options]
model = "qwen3.5-27b"
arms = "vanilla,folded"
""")
    plan = _load(path)
    assert [s.name for s in plan.steps] == ["main", "chain", "serve"]
    assert plan.steps[0].min_s == 60 and plan.steps[1].min_s == 100
    out = tmp_path / "run"
    main, chain, serve = campaign.resolve(plan, out)
    assert list(main.argv[1:]) == ["-m", "tunekit", "search", "--model", "qwen3.5-27b", "--m", "1,2", "--trials", "3",
                                   "--seed-from", str(seed), "--seed-from", f"{REPO}/pyproject.toml",
                                   "--restrict", "W_EVICT=", "--no-progress"]
    assert main.takes_out and not main.takes_stop_after
    assert chain.argv[-2:] == ("--table", f"{out.resolve()}/main/table.json")
    assert chain.env == {"PYTHONPATH": f"{REPO}/x::{os.environ.get('HOME', '')}",
                         "TUNEKIT_X": f"{out.resolve()}/chain/x"}
    assert serve.takes_stop_after  # serve-bench gets --stop-after the budget left


@pytest.mark.parametrize("body, fragment", [
    ('[[step]]\nname = "a"\nverb = "serch"\nestimate_s = 1\n', "unknown verb 'serch' (did you mean 'search'?"),
    ('[[step]]\nname = "a"\nverb = "search"\nestimate_s = 1\nestimate = 2\n', "unknown key 'estimate'"),
    ('[[step]]\nname = "a"\nverb = "search"\nestimate_s = 1\n[step.options]\nsed-from = ["x"]\n',
     "unknown option 'sed-from' of `tunekit search` (did you mean 'seed-from'?"),
    ('[[step]]\nname = "a"\nverb = "search"\nestimate_s = 1\n[step.options]\ntrials = "many"\n',
     "trials: expected an integer"),
    ('[[step]]\nname = "a"\nverb = "search"\nestimate_s = 1\n[step.options]\nmodel = ["a", "b"]\n',
     "model: takes one value"),
    ('[[step]]\nname = "a"\nverb = "search"\nestimate_s = 1\n[step.options]\nout = "x"\n',
     "the runner gives `--out` the step's folder"),
    ('[[step]]\nname = "a"\nverb = "probe"\n', "needs estimate_s"),
    ('[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 5\nmin_s = 9\n', "min_s 9 is above estimate_s 5"),
    ('[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 1\n[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 1\n',
     "two steps are named 'a'"),
    ('[[step]]\nname = "a"\nverb = "script"\nestimate_s = 1\n', "a script step needs run"),
    ('[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 1\nrun = ["x.py"]\n', "`run` is for verb = \"script\""),
    ('[[step]]\nname = "a"\nverb = "chain"\nestimate_s = 1\n[step.options]\ntable = ["{outdir}/t.json"]\n',
     "unknown placeholder {outdir}"),
    ('[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 1\nout = "../up"\n', "expected a folder name inside"),
    ('[[step]]\nname = "a"\nverb = "campaign"\nestimate_s = 1\n', "unknown verb 'campaign'"),
    ('[[step]]\nname = "a"\nverb = "check-serving"\nestimate_s = 1\n[step.options]\ntiny = "yes"\n',
     "tiny: expected true or false"),
    ('[[step]]\nname = "a"\nverb = "show"\nestimate_s = 1\n', "`tunekit show` needs args = [TABLE]"),
    ('[[step]]\nname = "a"\nverb = "chain"\nestimate_s = 1\n[step.options]\nmodel = "qwen3.5-27b"\n',
     "`tunekit chain` needs the option(s) --table"),
])
def test_plan_errors_are_caught_when_loading(tmp_path: Path, body: str, fragment: str) -> None:
    with pytest.raises(UserError) as caught:
        _load(_write(tmp_path, HEAD + body))
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text, fragment", [
    ("[campaign]\nname = \"t\"\n", "needs at least one [[step]]"),
    ("[[step]]\nname = \"a\"\nverb = \"probe\"\nestimate_s = 1\n", "needs a [campaign] table"),
    ("[campaign]\nname = \"t\"\nbudget = 3\n", "unknown key 'budget'"),
    ("[campaign]\nname = 't'\n[[step]\n", "not valid TOML"),
    ("[campaign]\nname = \"bad name\"\n", "expected a name of letters"),
])
def test_plan_errors_of_the_campaign_table(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(UserError, match=None) as caught:
        _load(_write(tmp_path, text))
    assert fragment in str(caught.value)


def test_missing_inputs_are_caught_before_anything_runs(tmp_path: Path) -> None:
    plan = _load(_write(tmp_path, HEAD + """
[[step]]
name = "main"
verb = "search"
estimate_s = 1
[step.options]
seed-from = ["benchmarks/results/no-such-run/trials.csv"]
"""))
    with pytest.raises(UserError, match="seed-from benchmarks/results/no-such-run/trials.csv: no such file"):
        campaign.resolve(plan, tmp_path / "run")
    # an input inside the campaign folder must be written by an earlier step
    plan = _load(_write(tmp_path, HEAD + """
[[step]]
name = "chain"
verb = "chain"
estimate_s = 1
[step.options]
table = ["{out}/main/table.json"]
[[step]]
name = "main"
verb = "search"
estimate_s = 1
"""))
    with pytest.raises(UserError, match="inside the campaign folder, but no earlier step writes there"):
        campaign.resolve(plan, tmp_path / "run")
    plan = _load(_write(tmp_path, HEAD + '[[step]]\nname = "s"\nverb = "script"\nestimate_s = 1\n'
                                                      'run = ["benchmarks/probes/no_such_probe.py"]\n'))
    with pytest.raises(UserError, match="script benchmarks/probes/no_such_probe.py: no such file"):
        campaign.resolve(plan, tmp_path / "run")


def test_the_cli_says_a_plan_error_in_one_line_and_creates_nothing(tmp_path: Path) -> None:
    path = _write(tmp_path, HEAD + '[[step]]\nname = "a"\nverb = "probe"\nestimate_s = 1\n[step.options]\nx = 1\n')
    done = _cli(path, "--out", tmp_path / "run")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()
    done = _cli(tmp_path / "nope.toml", "--out", tmp_path / "run")
    assert done.returncode == 2 and "error: no such plan" in done.stderr


# -- running ---------------------------------------------------------------------------------------------


def _two_step_plan(tmp_path: Path, second_estimate: int = 100) -> Path:
    script = _script(tmp_path)
    return _write(tmp_path, HEAD + f"""
[[step]]
name = "shapes"
verb = "shapes"
estimate_s = 5
about = "the problems of the model"
[step.options]
model = "qwen3.5-27b"
json = true

[[step]]
name = "work"
verb = "script"
estimate_s = {second_estimate}
run = ["{script}", "{{step}}", "0", "0"]
""")


def test_budget_stops_before_a_step_and_a_rerun_resumes(tmp_path: Path) -> None:
    plan, out, pack = _two_step_plan(tmp_path), tmp_path / "run", tmp_path / "packed" / "run.tgz"
    dry = _cli(plan, "--out", out, "--budget-s", 60, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "tunekit shapes --model qwen3.5-27b --json" in dry.stdout
    assert "estimate of the steps not done: 105 s" in dry.stdout and "[past this call's budget]" in dry.stdout
    assert not out.exists()

    first = _cli(plan, "--out", out, "--budget-s", 60, "--pack", pack)
    assert first.returncode == 3, first.stdout + first.stderr
    assert "stopped before step work: its estimate 100 s does not fit" in first.stdout
    state = _state(out)
    assert state["format"] == "tunekit.campaign/1" and state["name"] == "t"
    shapes, work = state["steps"]
    assert shapes["state"] == "done" and shapes["exit_code"] == 0 and shapes["attempts"] == 1
    assert shapes["command"][1:] == ["-m", "tunekit", "shapes", "--model", "qwen3.5-27b", "--json"]
    assert shapes["wall_s"] > 0 and shapes["started"] and shapes["ended"]
    assert "gpu" in shapes and "commit" in shapes
    assert json.loads((out / "logs" / "shapes.log").read_text().split("\n", 1)[1])  # the verb's output
    assert work["state"] == "not started" and work["command"] is None
    assert state["calls"][0]["budget_s"] == 60 and "does not fit" in state["calls"][0]["result"]
    assert pack.is_file()
    readme = (out / "README.md").read_text()
    assert "# Campaign `t`" in readme and "A test campaign." in readme and "the problems of the model" in readme
    assert "| 1 | shapes | shapes | done | 0 |" in readme and "| 2 | work | script | not started |" in readme
    assert "tunekit shapes --model qwen3.5-27b --json" in readme
    assert (out / "plan.toml").read_text() == plan.read_text()

    second = _cli(plan, "--out", out, "--pack", pack)
    assert second.returncode == 0, second.stdout + second.stderr
    state = _state(out)
    assert [s["state"] for s in state["steps"]] == ["done", "done"]
    assert state["steps"][0]["attempts"] == 1  # not run again
    assert (out / "work" / "done").exists()
    assert len(state["calls"]) == 2 and "every step of t is done" in state["calls"][1]["result"]
    assert "2 of 2 steps done" in (out / "README.md").read_text()
    import tarfile

    with tarfile.open(pack) as tar:
        names = tar.getnames()
    assert "run/campaign.json" in names and "run/work/done" in names and "run/.campaign.lock" not in names


def test_a_failed_step_stops_the_campaign_and_a_rerun_retries_it(tmp_path: Path) -> None:
    script = _script(tmp_path)
    plan = _write(tmp_path, HEAD + f"""
[[step]]
name = "bad"
verb = "script"
estimate_s = 5
run = ["{script}", "{{step}}", "0", "7"]
[[step]]
name = "after"
verb = "models"
estimate_s = 5
""")
    out = tmp_path / "run"
    done = _cli(plan, "--out", out)
    assert done.returncode == 1
    bad, after = _state(out)["steps"]
    assert bad["state"] == "failed" and bad["exit_code"] == 7 and "exit status 7" in bad["note"]
    assert after["state"] == "not started"
    # continue_on_failure: the steps after it run; the campaign still ends in failure
    plan.write_text(plan.read_text().replace('estimate_s = 5\nrun', 'estimate_s = 5\ncontinue_on_failure = true\nrun'))
    done = _cli(plan, "--out", out)
    assert done.returncode == 1 and "failed: bad" in done.stdout
    bad, after = _state(out)["steps"]
    assert bad["state"] == "failed" and after["state"] == "done"


def test_the_budget_ends_a_running_step_as_stopped(tmp_path: Path) -> None:
    script = _script(tmp_path)
    plan = _write(tmp_path, HEAD + f"""
[[step]]
name = "long"
verb = "script"
estimate_s = 600
min_s = 1
run = ["{script}", "{{step}}", "60", "0"]
""")
    out = tmp_path / "run"
    t0 = time.monotonic()
    done = _cli(plan, "--out", out, "--budget-s", 4)
    assert time.monotonic() - t0 < 40
    assert done.returncode == 3, done.stdout + done.stderr
    (rec,) = _state(out)["steps"]
    assert rec["state"] == "stopped" and "end of the budget" in rec["note"]
    assert (out / "long" / "started").exists() and not (out / "long" / "done").exists()


def test_a_changed_step_runs_again_and_another_campaign_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    plan = _write(tmp_path, HEAD + '[[step]]\nname = "m"\nverb = "models"\nestimate_s = 5\n')
    assert _cli(plan, "--out", out).returncode == 0
    plan.write_text(HEAD + '[[step]]\nname = "m"\nverb = "shapes"\nestimate_s = 5\n[step.options]\nm = "1"\n'
                           'shape = ["64x128"]\n')
    state = campaign.runner.state_mod.load(out, _load(plan))
    assert state["steps"][0]["state"] == "not started" and "changed" in state["steps"][0]["note"]
    other = _write(tmp_path, '[campaign]\nname = "other"\n[[step]]\nname = "m"\nverb = "models"\nestimate_s = 5\n',
                   "other.toml")
    done = _cli(other, "--out", out)
    assert done.returncode == 2 and "holds campaign 't', not 'other'" in done.stderr


def test_sigterm_stops_the_step_and_leaves_a_consistent_state(tmp_path: Path) -> None:
    script = _script(tmp_path)
    plan = _write(tmp_path, HEAD + f"""
[[step]]
name = "long"
verb = "script"
estimate_s = 30
run = ["{script}", "{{step}}", "60", "0"]
[[step]]
name = "after"
verb = "models"
estimate_s = 5
""")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "tunekit", "campaign", str(plan), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "long" / "started").exists() or not (out / "long" / "started").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    step_pid = int((out / "long" / "started").read_text())
    assert _state(out)["steps"][0]["state"] == "running"
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM during step long" in stdout
    state = _state(out)
    long, after = state["steps"]
    assert long["state"] == "stopped" and long["exit_code"] is not None and after["state"] == "not started"
    assert "SIGTERM" in state["calls"][0]["result"] and state["calls"][0]["ended"]
    assert not (out / "long" / "done").exists()
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())  # no half-written state file left
    with pytest.raises(ProcessLookupError):  # the step's process went with it
        os.kill(step_pid, 0)
    # a rerun resumes at the stopped step
    script.write_text(STEP_SCRIPT.replace("float(sys.argv[2])", "0"))
    done = _cli(plan, "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s["state"] for s in _state(out)["steps"]] == ["done", "done"]
    assert _state(out)["steps"][0]["attempts"] == 2


def test_a_second_runner_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    plan = _load(_write(tmp_path, HEAD + '[[step]]\nname = "m"\nverb = "models"\nestimate_s = 5\n'))
    with campaign.runner.state_mod.CampaignLock(out):
        with pytest.raises(UserError, match="in use by another campaign runner"):
            campaign.run_campaign(plan, out, echo=False, log=lambda s: None)


# -- the shipped plans -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks" / "plans").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_plan_loads_and_resolves(path: Path, tmp_path: Path) -> None:
    plan = _load(path)
    rendered = campaign.resolve(plan, tmp_path / "run")
    assert rendered and all(r.step.estimate_s > 0 for r in rendered)
    assert plan.about, f"{path.name}: say in [campaign] about what the campaign measures"


def test_plan_docstring_example_is_a_valid_plan(tmp_path: Path) -> None:
    text = textwrap.dedent(plan_mod.__doc__.split("\n``args")[0].split("\n", 1)[1])
    plan = _load(_write(tmp_path, text))
    assert [s.verb for s in plan.steps] == ["search", "script"]
    assert os.path.basename(plan.steps[1].run[0]) == "dispatch_overhead.py"
