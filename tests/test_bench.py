"""tunekit.measure.bench.release_memory: memory returned to the driver is waited for while it is cleared."""

from __future__ import annotations

import pytest
import torch

from tunekit.measure import bench


class _FakeCuda:
    """torch.cuda's calls release_memory makes, on a machine without a GPU: ``reserved`` is what the
    caching allocator holds before and after empty_cache."""

    def __init__(self, reserved: tuple[int, int], used: bool = True) -> None:
        self.reserved = list(reserved)
        self.used = used
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.used)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.used)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.calls.append("synchronize"))
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty_cache)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.reserved[0])

    def _empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved.pop(0)


def test_release_memory_waits_in_proportion_to_what_it_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(bench.time, "sleep", slept.append)
    cuda = _FakeCuda((int(54e9), int(4e9)))  # a 50 GB chain's weights returned, 4 GB still cached
    cuda.install(monkeypatch)
    waited = bench.release_memory()
    assert cuda.calls == ["synchronize", "empty_cache"]  # the frees are done before they are measured
    assert waited == pytest.approx(50e9 / bench.FREED_CLEAR_BYTES_PER_S) == pytest.approx(0.25)
    assert slept == [waited]


def test_release_memory_does_not_wait_when_nothing_was_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(bench.time, "sleep", slept.append)
    cuda = _FakeCuda((int(4e9), int(4e9)))
    cuda.install(monkeypatch)
    assert bench.release_memory() == 0.0 and slept == []


def test_release_memory_leaves_a_process_that_never_used_the_gpu_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda((int(54e9), 0), used=False)
    cuda.install(monkeypatch)
    assert bench.release_memory() == 0.0 and cuda.calls == []  # no CUDA context is made for it


def test_the_clearing_rate_is_below_the_one_measured() -> None:
    """The wait must cover the window measured on the H200 (120 GB freed: slow for 0.3 s, about 400 GB/s)."""
    assert 120e9 / bench.FREED_CLEAR_BYTES_PER_S >= 0.3
