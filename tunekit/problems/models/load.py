"""Loading model specs: a built-in model by name (``configs/*.json``), or a Hugging Face ``config.json``.

The built-in models live in ``configs/*.json`` (package data). Each file holds
checked facts: the config fields plus the expected ``decode_linears`` per TP,
which the tests compare the derivation against; this module reads only
``name``, ``hf_id`` and ``config`` from them. Every error is a
:class:`~tunekit.errors.UserError` of one line naming the file.
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.problems.models.spec import ModelSpec

_BUILTIN_PACKAGE = "tunekit.problems.models"
_BUILTIN_DIR = "configs"


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"model config not found: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: cannot read: not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def _spec_from_document(doc: Any, origin: str, default_name: str) -> ModelSpec:
    """A HF config.json, or a tunekit model file ({"name", "hf_id", "config", ...})."""
    if not isinstance(doc, dict):
        raise UserError(f"{origin}: expected a JSON object, got {type(doc).__name__}")
    if "model_type" not in doc and isinstance(doc.get("config"), dict):
        name = doc.get("name") if isinstance(doc.get("name"), str) else default_name
        hf_id = doc.get("hf_id") if isinstance(doc.get("hf_id"), str) else None
        return ModelSpec.from_config(copy.deepcopy(doc["config"]), name=name, hf_id=hf_id, origin=origin)
    hf_id = doc.get("_name_or_path") if isinstance(doc.get("_name_or_path"), str) else None
    name = os.path.basename(hf_id.rstrip("/")) if hf_id else default_name
    return ModelSpec.from_config(doc, name=name or default_name, hf_id=hf_id, origin=origin)


def load_config_file(path: str | os.PathLike[str]) -> ModelSpec:
    """Load a Hugging Face ``config.json`` (or a checkpoint folder holding one)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    # A snapshot folder's name is the model's; a stray file is named by its stem.
    default = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return _spec_from_document(_read_json(path), str(path), default)


@lru_cache(maxsize=1)
def _builtin_documents() -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """(name, file, document) of every built-in model, sorted by name."""
    folder = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_DIR)
    docs = []
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            origin = f"tunekit/problems/models/{_BUILTIN_DIR}/{entry.name}"
            try:
                doc = json.loads(entry.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:  # a broken install, not user input
                raise UserError(f"{origin}: built-in model file unreadable: {exc}") from None
            docs.append((str(doc.get("name") or entry.name[: -len(".json")]), origin, doc))
    return tuple(sorted(docs, key=lambda item: item[0]))


def _builtin_spec(name: str, origin: str, doc: dict[str, Any]) -> ModelSpec:
    # Deep copy: callers get their own config dict, the cache stays pristine.
    return _spec_from_document(copy.deepcopy(doc), origin, name)


def list_models() -> list[ModelSpec]:
    """The built-in models, sorted by name."""
    return [_builtin_spec(*item) for item in _builtin_documents()]


def _builtin_index() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Lower-case lookup keys -> built-in: names, HF ids, and names without "-instruct"."""
    index: dict[str, tuple[str, str, dict[str, Any]]] = {}
    short: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for item in _builtin_documents():
        name, _, doc = item
        index[name.lower()] = item
        if isinstance(doc.get("hf_id"), str):
            index.setdefault(doc["hf_id"].lower(), item)
        short.setdefault(re.sub(r"-instruct$", "", name.lower()), []).append(item)
    for key, items in short.items():
        if len(items) == 1:  # only unambiguous aliases ("llama-3.1-8b")
            index.setdefault(key, items[0])
    return index


def load_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A built-in model by name (case-insensitive; HF id or name without "-instruct"
    also work), else a path to a Hugging Face ``config.json`` or its folder.

    Raises :class:`UserError` for an unknown name, a missing file, or a config
    that cannot be used.
    """
    text = os.fspath(name_or_path).strip()
    if not text:
        raise UserError("no model given (a built-in name or a path to a config.json)")
    item = _builtin_index().get(text.lower())
    if item is not None:
        return _builtin_spec(*item)
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".json"):
        return load_config_file(path)
    names = ", ".join(name for name, _, _ in _builtin_documents())
    raise UserError(
        f"unknown model {text!r}: not a built-in ({names}) and no such file "
        "(give a path to a Hugging Face config.json)"
    )
