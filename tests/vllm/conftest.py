"""vLLM tier: runs in the vLLM 0.33 virtualenv (scripts/setup.sh), started by tests/test_vllm_plugin.py.

The main test environment has no vLLM (it pins its own torch), so this folder
is collected only when TUNEKIT_VLLM_TESTS=1, which the wrapper test sets.
Everything runs on the CPU: vLLM resolves to its UnspecifiedPlatform on a
machine without a GPU, whose GEMM and CustomOp dispatch are the CUDA ones
(default_unquantized_gemm, forward_cuda); tunekit's Triton kernels run on the
interpreter.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
if str(HERE.parent) not in sys.path:  # tests/fault_backend.py (fault_backend:WRONG); after this folder's modules
    sys.path.append(str(HERE.parent))

collect_ignore_glob = [] if os.environ.get("TUNEKIT_VLLM_TESTS") == "1" else ["test_*.py"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_config():
    """A CPU VllmConfig in scope for the whole session, and a one-process (gloo, loopback) TP group."""
    from vllm.config import (
        CompilationConfig,
        CompilationMode,
        DeviceConfig,
        PassConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # vLLM's fusion passes need its CUDA kernels; the eager backend still
    # runs vLLM's own compile pipeline (dynamo, graph split, piecewise).
    passes = PassConfig(**{name: False for name in (
        "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms", "enable_qk_norm_rope_fusion",
        "fuse_act_padding", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache", "fuse_mla_dual_rms_norm",
        "fuse_rope_kvcache_cat_mla")})
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                                             cudagraph_mode="NONE", compile_sizes=[], pass_config=passes),
    )
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        initialize_model_parallel(1, 1)
        yield config
