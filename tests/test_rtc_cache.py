"""The run-time compile cache shared by many processes (tensor-parallel workers, several engines, a search
beside a server): one compile per key, no partial file ever read, damaged entries rebuilt."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from tunekit import rtc
from tunekit.rtc import cache

RACERS = 8
KEYS = [cache.cache_key(f"src{i}", {"A": i}, arch="sm_90", compiler="test", target="cubin") for i in range(3)]


def _race_fake_builds(cache_root: str, builds_dir: str, start_at: float) -> list[str]:
    """One racer: every key through get_or_build, with a slow build that leaves a mark per real build."""
    os.environ["TUNEKIT_CACHE"] = cache_root
    while time.time() < start_at:  # all racers leave the gate together
        time.sleep(0.001)
    out = []
    for key in KEYS:
        def build(key: str = key) -> bytes:
            Path(builds_dir, f"{key[:12]}.{os.getpid()}").touch()
            time.sleep(0.2)  # a compile takes time: the others must wait, not compile too
            return (key * 50).encode()

        data, _ = cache.get_or_build(key, build)
        out.append(data.decode())
    return out


@pytest.mark.faults  # 8 racing processes, for real: in the README's test command however long it takes
def test_racing_processes_build_each_key_once(tmp_path: Path) -> None:
    builds = tmp_path / "builds"
    builds.mkdir()
    ctx = mp.get_context("spawn")
    with ctx.Pool(RACERS) as pool:
        start_at = time.time() + 3.0  # spawn start-up is ~1 s per racer on 2 cores
        results = pool.starmap(_race_fake_builds, [(str(tmp_path / "cache"), str(builds), start_at)] * RACERS)
    expected = [key * 50 for key in KEYS]
    assert all(r == expected for r in results), "a racer read a partial or foreign entry"
    marks = sorted(p.name.split(".")[0] for p in builds.iterdir())
    assert marks == sorted(k[:12] for k in KEYS), f"keys built more than once: {marks}"
    left = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert not left, left


def _race_nvrtc(cache_root: str, start_at: float) -> list[tuple[str, bool, bytes]]:
    os.environ["TUNEKIT_CACHE"] = cache_root
    from tunekit.measure.device import DeviceInfo

    sm90 = DeviceInfo(vendor="nvidia", name="H200 (compile only)", arch="sm_90", cu_count=132, wave_size=32,
                      l2_bytes=60 * 2**20, memory_bytes=0, runtime="cuda", torch_device="cuda:0")
    while time.time() < start_at:
        time.sleep(0.001)
    out = []
    for unroll in (1, 2, 4):
        module = rtc.compile_kernel("gemv", {"WAVE": 32, "MAX_M": 1, "VEC": 8, "UNROLL": unroll}, sm90)
        out.append((module.key, module.cache_hit, module.binary))
    return out


@pytest.mark.faults  # 8 racing processes, for real: in the README's test command however long it takes
@pytest.mark.needs("nvrtc")
def test_racing_processes_compile_real_kernels_once(tmp_path: Path) -> None:
    """Eight processes compile the same three HIP GEMV variants (NVRTC, sm_90) into one cache."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(RACERS) as pool:
        results = pool.starmap(_race_nvrtc, [(str(tmp_path / "cache"), time.time() + 6.0)] * RACERS)
    by_key: dict[str, set[bytes]] = {}
    compiled = 0
    for racer in results:
        for key, hit, binary in racer:
            by_key.setdefault(key, set()).add(binary)
            compiled += not hit
    assert len(by_key) == 3 and all(len(b) == 1 for b in by_key.values()), "racers got different binaries"
    assert compiled == 3, f"{compiled} compiles for 3 keys across {RACERS} processes"
    entries = [p for p in (tmp_path / "cache").rglob("*.bin")]
    assert len(entries) == 3


def test_damaged_entry_reads_as_a_miss_and_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))
    key = KEYS[0]
    path = cache.store(key, b"x" * 1000)
    assert path is not None and cache.load(key) == b"x" * 1000
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])  # cut short, as a full disk or an interrupted copy leaves it
    assert cache.load(key) is None
    path.write_bytes(raw[:-1] + b"y")  # same length, one byte changed
    assert cache.load(key) is None
    path.write_bytes(b"x" * 1000)  # an entry of the old, headerless format
    assert cache.load(key) is None
    data, built = cache.get_or_build(key, lambda: b"fresh")
    assert (data, built) == (b"fresh", True) and cache.load(key) == b"fresh"


def test_unwritable_cache_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TUNEKIT_CACHE", str(blocker / "cache"))
    data, built = cache.get_or_build(KEYS[1], lambda: b"code")
    assert (data, built) == (b"code", True)
    assert cache.load(KEYS[1]) is None


def test_failed_build_releases_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))

    def broken() -> bytes:
        raise RuntimeError("compile error")

    with pytest.raises(RuntimeError):
        cache.get_or_build(KEYS[2], broken)
    assert cache.load(KEYS[2]) is None
    assert cache.get_or_build(KEYS[2], lambda: b"ok") == (b"ok", True)  # not deadlocked on its own lock
