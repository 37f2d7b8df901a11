"""The protocol the elementwise kernels' config dataclasses share (tunekit.backends.triton uses it)."""

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
