"""Serving the dispatch tables as ``torch.ops.tunekit.*`` custom ops (implementation of ``tunekit.ops``).

``tunekit.ops`` is the public API and the module to import: importing it
registers the ops. This package holds its parts, one responsibility each,
bottom first (a module imports only modules listed above it):

* ``state``: the serving vocabulary and the one process-wide ``STATE``
  (tables, decision cache, built kernels, markers, vendor paths, the log's writer);
* ``launch``: bound launchers (a Triton kernel's call replayed without its launch path);
* ``canary``: ``TUNEKIT_CANARY``, one call in N of each tuned key checked against its fp64 reference;
* ``vendors``: the vendor paths integrations install;
* ``markers``: the dispatch markers (call counters) and when the dispatch log is written;
* ``tables``: loading ``TUNEKIT_TABLE``, the per-device environment and TP checks, the merged table;
* ``log``: the dispatch log's document and writer (installed as ``STATE.log_writer``);
* ``decisions``: the decision cache (lookup, build, broken kernels);
* ``elementwise_route``: what serves one elementwise key, resolved once;
* ``elementwise_fallback``: the elementwise fallbacks (installed vendor kernel, default-config kernel);
* ``gemv`` / ``fused_gemv``: those ops' run-time and fake impls, with their fallbacks;
* ``elementwise``: the elementwise ops' run-time and fake impls and PyTorch compositions;
* ``warmup``: ``prepare``, building kernels before CUDA-graph capture;
* ``registry``: the ``torch.library`` definitions.

Importing this package imports none of them (nor torch).
"""
