"""Disk cache of compiled code objects (cubin / AMD code objects).

Call protocol::

    key = cache_key(source, defines, arch=..., compiler=..., target=...)
    blob = load(key)              # bytes, or None on a miss
    if blob is None:
        blob = compile(...)
        store(key, blob)          # atomic: temp file + rename

The key is a sha256 over everything that changes the binary: the full source
text (the op's .hip file with ``tunekit_hip.h`` inlined), the defines sorted by
name, the target arch, the compiler and its version, and the compile options.
Entries are immutable, so concurrent writers (several search workers) are
harmless: the last rename wins with identical bytes.

Location: ``$TUNEKIT_CACHE`` if set, else ``~/.cache/tunekit/rtc``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Bump when the key layout or the stored format changes.
_FORMAT = 1


def cache_dir() -> Path:
    """The directory that holds the code objects (not created here)."""
    root = os.environ.get("TUNEKIT_CACHE")
    if root:
        return Path(root).expanduser()
    return Path.home() / ".cache" / "tunekit" / "rtc"


def cache_key(
    source: str,
    defines: Mapping[str, int | str],
    *,
    arch: str,
    compiler: str,
    target: str,
    options: Sequence[str] = (),
) -> str:
    """Hex sha256 naming one compiled variant."""
    payload = json.dumps(
        {
            "format": _FORMAT,
            "source": hashlib.sha256(source.encode()).hexdigest(),
            "defines": sorted((str(k), str(v)) for k, v in defines.items()),
            "arch": arch,
            "compiler": compiler,
            "target": target,
            "options": list(options),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def path_for(key: str, suffix: str = ".bin") -> Path:
    # Two-level fan-out keeps directories small after long searches.
    return cache_dir() / key[:2] / f"{key}{suffix}"


def load(key: str, suffix: str = ".bin") -> bytes | None:
    """The cached bytes for ``key``, or None (missing or unreadable)."""
    try:
        data = path_for(key, suffix).read_bytes()
    except OSError:
        return None
    return data or None


def store(key: str, data: bytes, suffix: str = ".bin") -> Path | None:
    """Write ``data`` atomically; returns the path, or None if the cache is not writable.

    A read-only or full cache never fails a build: the code object is still
    returned to the caller, only not remembered.
    """
    path = path_for(key, suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return None
    return path
