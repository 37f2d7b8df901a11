"""Serving the dispatch tables as ``torch.ops.tunekit.*`` custom ops (implementation of ``tunekit.ops``).

``tunekit.ops`` is the public API and the module to import: importing it
registers the ops. This package holds its parts, one responsibility each:

* ``state``: the serving vocabulary and the one process-wide ``STATE``;
* ``tables``: loading ``TUNEKIT_TABLE``, the per-device environment check, the merged table;
* ``decisions``: the decision cache (lookup, build, broken kernels);
* ``markers``: dispatch markers and the dispatch log;
* ``vendors``: the vendor paths integrations install;
* ``gemv`` / ``fused_gemv`` / ``elementwise``: the ops' run-time and fake impls, with their fallbacks;
* ``warmup``: ``prepare``, building kernels before CUDA-graph capture;
* ``registry``: the ``torch.library`` definitions.

Importing this package imports none of them (nor torch).
"""
