"""The three layers of evidence, never mixed, each its own module or package:

* ``compare``: the standalone microbenchmarks of a run (Triton vs HIP vs vendor vs the peers per problem
  and per token, percent of the read limit, Amdahl's prediction, plots) -- ``tunekit compare``; the
  figures it reads are ``comparison``'s (final.csv loaded), the calls per token it counts
  ``served_path``'s (one served path per layer), its PNGs ``plots``';
* ``chain``: a model's decode-step chain as one CUDA graph, vendor vs tuned -- ``tunekit chain``;
* ``serve_bench``: the served model in vLLM, vanilla vs passthrough vs tuned -- ``tunekit serve-bench``;
* ``check_serving``: that a table serves correctly (eager, compiled, graphed; a Hugging Face model's
  logits and tokens) -- ``tunekit check-serving``.

``campaign`` runs the device campaigns that gather them: a plan of tunekit verbs (and scripts) run in order
within a device-time budget, resumable -- ``tunekit campaign``.

``console`` makes the rich console the command line prints its reports on; ``search_summary`` is what
``tunekit search`` prints at its end (its studies, the re-measure, then ``compare``'s report).

Importing this package imports nothing else.
"""
