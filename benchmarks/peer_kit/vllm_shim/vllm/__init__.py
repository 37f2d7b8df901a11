"""Only what vLLM 0.33.0's CuTe-DSL skinny GEMM imports from vLLM, for timing that kernel alone.

vLLM 0.33 needs a newer torch than the lent GPU image has (torch 2.11), so the peer kit carries the
kernel's two files verbatim from the vllm-0.33.0 wheel (``model_executor/kernels/linear/cute_dsl/
skinny_gemm.py`` and ``_skinny_gemm.py``) and these stand-ins for the two vLLM functions they call:
``vllm.utils.torch_utils.current_stream`` (the stream to compile against) and
``vllm.platforms.current_platform.is_arch_support_pdl`` (PDL on SM90 and newer, as vLLM's CUDA platform).
The figure measured through it is that kernel's, at vLLM's own heuristic config and compile options.
"""
