"""What the Triton kernels' configs share: the config protocol (tunekit.backends.triton uses it) and
the pure arithmetic their ``invalid_reason`` predicates and wrappers use."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, TypeVar

_C = TypeVar("_C", bound="StrictConfig")


class StrictConfig:
    """Mixin of a frozen dataclass of tunables and numerics switches."""

    @classmethod
    def from_params(cls: type[_C], params: dict[str, Any]) -> _C:
        """Strict: an unknown key is a TypeError (a misspelt tunable must not pass silently)."""
        return cls(**params)

    def as_params(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


def next_pow2(value: int) -> int:
    """The smallest power of two >= ``value`` (1 for values below 1)."""
    return 1 << (max(value, 1) - 1).bit_length()


def is_pow2(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


#: Largest M of every GEMV-family kernel: each keeps all M rows of x on the W tile it holds, so W is read once
#: per call; 16 covers decode batches and speculative decoding's verify steps (M = 1 + k draft tokens).
GEMV_MAX_M = 16


def gemv_head_reason(config: Any, m: int, n: int, k: int) -> str | None:
    """The checks every GEMV-family config starts with (the fused families' ``invalid_reason``):
    power-of-two BLOCK_N / BLOCK_K / num_warps, 1..4 stages, a known W_EVICT, M in 1..GEMV_MAX_M, a
    non-empty problem. None if they pass, else a short reason."""
    for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
        if not is_pow2(getattr(config, name)):
            return f"{name}={getattr(config, name)} is not a power of two"
    if not 1 <= config.num_stages <= 4:
        return f"num_stages={config.num_stages} outside 1..4"
    if config.W_EVICT not in ("", "evict_first"):
        return f"unknown W_EVICT {config.W_EVICT!r}"
    if not 1 <= m <= GEMV_MAX_M:
        return f"M={m} outside 1..{GEMV_MAX_M}"
    if n < 1 or k < 1:
        return f"empty problem (N={n}, K={k})"
    return None
