"""The stand-in's engine arguments: only what benchmarks/endpoint_ab.sh feature-detects (vLLM 0.26's drain mode)."""

from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str = ""
    shutdown_timeout: int = 0
