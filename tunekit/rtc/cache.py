"""Disk cache of compiled code objects (cubin / AMD code objects).

Call protocol::

    key = cache_key(source, defines, arch=..., compiler=..., target=...)
    blob, built = get_or_build(key, lambda: compile(...))   # one compile per key across processes

    # or by hand:
    blob = load(key)              # bytes, or None on a miss (or a damaged entry)
    if blob is None:
        blob = compile(...)
        store(key, blob)          # atomic: temp file, fsync, rename

The key is a sha256 over everything that changes the binary: the full source
text (the op's .hip file with ``tunekit_hip.h`` inlined), the defines sorted by
name, the target arch, the compiler and its version, and the compile options.
Safe across processes (search workers, tensor-parallel vLLM workers, several
engines, a search beside a server, all sharing one cache):

* one writer per key: ``get_or_build`` holds an exclusive ``flock`` on the
  key's lock file (``.locks/``) while it checks, compiles and stores, so the
  others wait for it and then read its entry instead of compiling again;
* readers never see a partial file: an entry is written to a temp file in the
  same directory, flushed to disk and renamed over the name (atomic);
* an entry carries its own length and sha256: a damaged file (a disk that
  filled, a copy cut short) reads as a miss and is rebuilt, never loaded.

Location: ``$TUNEKIT_CACHE`` if set, else ``~/.cache/tunekit/rtc``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

try:  # POSIX; elsewhere the cache works without the one-writer lock (entries stay atomic and checked)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: Bump when the key layout or the stored format changes.
_FORMAT = 2
#: Stored entry: magic, 8-byte little-endian length, 32-byte sha256 of the payload, then the payload.
_MAGIC = b"TKRTC2\0\0"
_HEADER = len(_MAGIC) + 8 + 32


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


def _unpack(raw: bytes) -> bytes | None:
    if len(raw) < _HEADER or not raw.startswith(_MAGIC):
        return None
    size = int.from_bytes(raw[len(_MAGIC):len(_MAGIC) + 8], "little")
    digest, payload = raw[len(_MAGIC) + 8:_HEADER], raw[_HEADER:]
    if len(payload) != size or hashlib.sha256(payload).digest() != digest or not payload:
        return None
    return payload


def load(key: str, suffix: str = ".bin") -> bytes | None:
    """The cached bytes for ``key``, or None (missing, unreadable, or damaged: wrong length or checksum)."""
    try:
        raw = path_for(key, suffix).read_bytes()
    except OSError:
        return None
    return _unpack(raw)


def store(key: str, data: bytes, suffix: str = ".bin") -> Path | None:
    """Write ``data`` atomically (temp file, fsync, rename); returns the path, or None if the cache is not
    writable.

    A read-only or full cache never fails a build: the code object is still
    returned to the caller, only not remembered, and no temp file is left.
    """
    path = path_for(key, suffix)
    blob = _MAGIC + len(data).to_bytes(8, "little") + hashlib.sha256(data).digest() + data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return None
    return path


@contextlib.contextmanager
def key_lock(key: str) -> Iterator[bool]:
    """Hold the exclusive lock of ``key`` (blocking); yields False where no lock can be taken (a
    read-only cache, no ``fcntl``): the caller then proceeds unlocked, as a cache miss would."""
    if fcntl is None:
        yield False
        return
    lock_path = cache_dir() / ".locks" / f"{key}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock, also when the holder is killed


def get_or_build(key: str, build: Callable[[], bytes], suffix: str = ".bin") -> tuple[bytes, bool]:
    """``(bytes, built)``: the cached entry of ``key``, or ``build()`` stored under it. Across processes
    sharing the cache, one builds a key while the others wait for it and read its entry (``built`` is
    False for them). A ``build`` that raises stores nothing and releases the key."""
    data = load(key, suffix)
    if data is not None:
        return data, False
    with key_lock(key):
        data = load(key, suffix)  # built by the process we waited for
        if data is not None:
            return data, False
        data = build()
        store(key, data, suffix)
    return data, True
