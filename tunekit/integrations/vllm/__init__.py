"""The vLLM general plugin (``plugin.register``, found through the ``vllm.general_plugins`` entry point).

One duty per module, each importing only modules below it:

* ``plugin``: ``register`` / ``installed`` / ``skipped``; installs the hooks below and reports;
* ``gemm`` (hook ``linear``), ``custom_ops`` (the norms and SiLU-and-mul), ``compile`` (compile-cache
  key, compile ranges and their post-grad pass, whose body is ``graph_routes``), ``load`` (the fold and
  the merge after the weights load);
* ``vendors`` (vLLM's kernels as the elementwise ops' vendor path), ``coverage`` (whether a layer
  reaches a tunekit op), ``fold`` and ``merge`` (the load-time steps, no vLLM import);
* ``marks`` (what fold, merge and the routes share) and ``state`` (logger, switches, what was
  installed) at the bottom.

Importing this package imports neither vLLM nor torch; ``plugin`` imports torch (never vLLM) when vLLM
loads it.
"""
