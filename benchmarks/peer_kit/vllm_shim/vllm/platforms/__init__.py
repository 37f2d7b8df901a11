"""vLLM's ``current_platform`` as far as the skinny GEMM asks it: a CUDA platform, PDL from SM90 on."""

import torch


class _CudaPlatform:
    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_arch_support_pdl() -> bool:
        # vLLM's CudaPlatform: capability >= 90
        return torch.cuda.get_device_capability()[0] >= 9


current_platform = _CudaPlatform()
