"""Where the dispatch table meets a serving stack: ``torch_patch`` (any nn.Module) and the ``vllm`` plugin package.

Neither is imported by ``import tunekit``; the vLLM plugin is found
through the ``vllm.general_plugins`` entry point.
"""
