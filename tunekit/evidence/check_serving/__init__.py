"""`tunekit check-serving`: GPU evidence that a dispatch table serves correctly and what it saves.

``tunekit check-serving`` (and ``benchmarks/probes/serving_check.py``, a thin wrapper) run it:

* :mod:`tunekit.evidence.check_serving.checks`: the PASS / FAIL / SKIP / INFO report and the environment stamp.
* :mod:`tunekit.evidence.check_serving.ops_check`: every table entry's op eagerly, under ``torch.compile`` and
  under CUDA-graph capture + replay (bitwise equal to eager, within the op's BF16 bound).
* :mod:`tunekit.evidence.check_serving.hf_decode`: a few layers of a Hugging Face Qwen3.5-27B or Llama-3.1-8B
  (random weights, the real sizes), its eager decode and its graphed decode (static cache +
  ``torch.compile(mode="reduce-overhead")``).
* :mod:`tunekit.evidence.check_serving.judging`: the model check's pure judging and ratio arithmetic (logits
  against the model's own tolerance, near ties, same-run timing ratios, dispatch markers by kind).
* :mod:`tunekit.evidence.check_serving.model_check`: the model check (patched vs unpatched logits and greedy tokens,
  eager and graphed, the interleaved per-step timing of the four variants), its report, and
  :func:`~tunekit.evidence.check_serving.model_check.run_check`.

Importing this package imports neither torch nor transformers; the modules do (transformers lazily).
"""
