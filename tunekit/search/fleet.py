"""Many workers on one Optuna storage: GPUs of a host, hosts of a fleet.

Nothing here coordinates directly; every decision goes through the storage
(Optuna's RDB storage: SQLite for one host, PostgreSQL for many):

- **Identity.** A worker is ``host:pid:slot`` (``slot`` = ``gpu<i>`` or
  ``cpu``); the host is ``TUNEKIT_HOST`` or the host name. Each trial records
  its ``owner`` (``host:pid``: the process, for liveness), its ``worker`` and
  the ``stamp`` of the device that measured it.
- **Liveness** is Optuna's heartbeat (``RDBStorage(heartbeat_interval,
  grace_period)`` + ``fail_stale_trials``); on its own host a worker also
  knows a dead pid at once. ``TUNEKIT_HEARTBEAT_S`` / ``TUNEKIT_GRACE_S``
  shorten both for fast fail-over.
- **One device model per storage.** :func:`device_stamp` names the GPU model
  and software stack; a study measured under another stamp is refused with
  one line (measurements of different devices are never merged).
- **The final re-measure of a problem runs once** (:class:`FinalClaims`): a
  study ``final|...`` keyed by the candidates it re-measures; a worker claims
  it by asking a trial there, and the claim is the lowest-numbered trial that
  is RUNNING or COMPLETE. The claimant's heartbeat keeps the claim; a dead
  claimant's trial is failed like any other and the next worker claims again.
  The re-measured rows are stored on the claim's trial, so every worker (and
  ``tunekit export --storage``) reads the same rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit.errors import UserError

FINAL_PREFIX = "final|"
#: Seconds between looks at the storage while waiting for work in flight elsewhere.
POLL_S = 1.0


def host_name() -> str:
    """The host this worker records (``TUNEKIT_HOST`` where containers share a host name)."""
    return os.environ.get("TUNEKIT_HOST") or socket.gethostname()


def heartbeat_settings(default_interval: int, default_grace: int) -> tuple[int, int]:
    """(heartbeat interval, grace period) in seconds; the environment may shorten them."""

    def read(name: str, default: int) -> int:
        text = os.environ.get(name)
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{name}={text!r}: expected a whole number of seconds") from None
        if value < 1:
            raise UserError(f"{name}={text!r}: must be at least 1")
        return value

    interval = read("TUNEKIT_HEARTBEAT_S", default_interval)
    grace = read("TUNEKIT_GRACE_S", default_grace)
    if grace <= interval:
        raise UserError(f"TUNEKIT_GRACE_S ({grace}) must be longer than the heartbeat interval ({interval})")
    return interval, grace


# ------------------------------------------------------------------ GPUs of this host
@dataclass(frozen=True)
class Slot:
    """One worker of this process: its label and the environment that pins it to a device."""

    label: str
    env: dict[str, str]


def parse_gpus(text: str | None, gpu_count: int, interpreter: bool) -> list[Slot]:
    """``--gpus 0,1 | all`` as worker slots; None: one worker on the default device.

    Indices are those of this process's visible devices (``CUDA_VISIBLE_DEVICES``
    / ``HIP_VISIBLE_DEVICES`` already set are honoured: index i is their i-th
    entry). Without a GPU, under the Triton interpreter, ``--gpus 0,...,N-1``
    gives N CPU workers (the pipeline, not a speed-up); any other value there
    (``all``, ``5``) asks for GPUs that are not there and is refused, as it is
    without the interpreter, with the count of visible GPUs.
    """
    if text is None:
        return [Slot("gpu0" if gpu_count else "cpu", {})]
    text = text.strip()
    if text == "all":
        if gpu_count == 0:
            raise UserError(f"--gpus all: {_no_gpu(interpreter)}")
        indices = list(range(gpu_count))
    else:
        try:
            indices = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise UserError(f"--gpus {text!r}: expected 'all' or device indices like 0,1") from None
        if not indices or any(i < 0 for i in indices):
            raise UserError(f"--gpus {text!r}: expected 'all' or device indices like 0,1")
        if len(set(indices)) != len(indices):
            raise UserError(f"--gpus {text!r}: an index is given twice")
        if gpu_count == 0 and not (interpreter and sorted(indices) == list(range(len(indices)))):
            raise UserError(f"--gpus {text}: {_no_gpu(interpreter)}")
        if gpu_count and max(indices) >= gpu_count:
            raise UserError(f"--gpus {text}: {gpu_count} GPU(s) visible here (indices 0..{gpu_count - 1})")
    if gpu_count == 0:
        return [Slot(f"cpu{i}", {}) for i in sorted(indices)]
    slots = []
    for i in indices:
        env = {}
        for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
            visible = [v.strip() for v in os.environ.get(var, "").split(",") if v.strip()]
            env[var] = visible[i] if i < len(visible) else str(i)
        slots.append(Slot(f"gpu{i}", env))
    return slots


def _no_gpu(interpreter: bool) -> str:
    """The rest of the one line for ``--gpus`` asking for GPUs on a host that shows none."""
    if interpreter:
        return ("no GPU is visible here (0 GPUs); under TRITON_INTERPRET=1, --gpus 0,1,...,N-1 runs N CPU workers "
                "(the pipeline, not a speed-up)")
    return "no GPU is visible here (0 GPUs; TRITON_INTERPRET=1 runs the Triton kernels on the CPU)"


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------ device stamp
#: The fields of tunekit.table.environment_stamp that make measurements comparable:
#: the device model and the software stack (kernel sources are the studies' own check).
_STAMP_FIELDS = ("gpu", "arch", "cu_count", "wave_size", "runtime", "torch", "triton")


def device_stamp(environment: dict[str, Any]) -> tuple[str, str]:
    """(stamp id, description) of a worker's device and software stack."""
    fields = {k: environment.get(k) for k in _STAMP_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    text = (f"{fields['gpu']} ({fields['arch']}, {fields['cu_count']} CUs), {fields['runtime']}, "
            f"torch {fields['torch']}, triton {fields['triton']}")
    return digest, text


def check_study_stamp(study: optuna.Study, stamp: str, description: str, url: str) -> None:
    """Record this device's stamp on a study, or refuse one measured on another device."""
    stored = study.user_attrs.get("stamp")
    if stored is None:
        study.set_user_attr("stamp", stamp)
        study.set_user_attr("stamp_text", description)
        return
    if stored != stamp:
        raise UserError(
            f"storage {redact(url)}: study {study.study_name} was measured on {study.user_attrs.get('stamp_text')} "
            f"(stamp {stored}); this worker is {description} (stamp {stamp}): measurements of different devices "
            "are never merged; use one --storage per device model")


def redact(url: str) -> str:
    """A storage URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: shown as given
        return url


# ------------------------------------------------------------------ final re-measure claims
def final_study_name(arch: str, problem_key: str, numerics: str, candidates: Sequence[dict[str, Any]]) -> str:
    """The claim study of one problem's final re-measure, keyed by what it re-measures: new trials
    that change the top candidates make a new final; a rerun with nothing new reads the stored one."""
    digest = hashlib.sha256(json.dumps(
        [(c["label"], c["backend"], c["params"]) for c in candidates], sort_keys=True).encode()).hexdigest()[:12]
    return f"{FINAL_PREFIX}{arch}|{problem_key}|{numerics}|{digest}"


def final_result(study: optuna.Study) -> dict[str, Any] | None:
    """The stored outcome of a completed final re-measure (rows, device, probe ...), or None."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if "rows" in trial.user_attrs:
            return {key: json.loads(trial.user_attrs[key]) for key in ("rows", "device", "probe", "backends")
                    if key in trial.user_attrs} | {"stamp": trial.user_attrs.get("stamp"),
                                                    "stamp_text": trial.user_attrs.get("stamp_text"),
                                                    "worker": trial.user_attrs.get("worker"),
                                                    "complete": trial.datetime_complete}
    return None


def holds_claim(study: optuna.Study, trial_number: int) -> bool:
    """Whether ``trial_number`` is the claim: the lowest-numbered RUNNING or COMPLETE trial."""
    live = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE))]
    return bool(live) and min(live) == trial_number


def finals_in_storage(storage) -> dict[str, list[dict[str, Any]]]:
    """Every completed final re-measure in ``storage``, newest per problem, grouped by device stamp."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if not summary.study_name.startswith(FINAL_PREFIX):
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        result = final_result(study)
        if result is None or not result.get("rows"):
            continue
        first = result["rows"][0]
        key = (result["stamp"], "|".join(str(first[f]) for f in ("op", "dtype", "m", "n", "k")))
        if key not in newest or result["complete"] > newest[key]["complete"]:
            newest[key] = result
    by_stamp: dict[str, list[dict[str, Any]]] = {}
    for (stamp, _), result in sorted(newest.items(), key=lambda kv: kv[0]):
        by_stamp.setdefault(stamp, []).append(result)
    return by_stamp


# ------------------------------------------------------------------ who took part
def participants(storage, study_names: Sequence[str]) -> dict[str, Any]:
    """Workers, GPUs and hosts that measured trials of these studies (from the trials' ``worker``)."""
    workers: set[str] = set()
    for name in study_names:
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            continue
        for trial in study.get_trials(deepcopy=False):
            if trial.user_attrs.get("measured") or "rows" in trial.user_attrs:
                workers.add(str(trial.user_attrs.get("worker") or trial.user_attrs.get("owner") or "?"))
    hosts = {w.split(":")[0] for w in workers}
    gpus = {f"{w.split(':')[0]}:{w.split(':')[-1]}" for w in workers
            if w.count(":") >= 2 and w.split(":")[-1].startswith("gpu")}
    return {"workers": len(workers), "gpus": len(gpus), "hosts": len(hosts), "worker_ids": sorted(workers)}
