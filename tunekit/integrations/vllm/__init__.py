"""The vLLM general plugin (``plugin.register``, found through the ``vllm.general_plugins`` entry point).

Importing this package imports neither vLLM nor torch; ``plugin`` does, when vLLM loads it.
"""
