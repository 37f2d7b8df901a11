"""``tunekit serve-bench``: the tables' end-to-end effect on vLLM decode, vanilla vs passthrough vs tuned (vs folded).

The layer of evidence after ``tunekit chain``: the whole served model, in
vLLM, with its attention, recurrence, sampling and scheduler, one engine per
process, arms alternated over processes.

Modules:

* ``runner``: the child process (``python -m tunekit.evidence.serve_bench.runner``): one
  arm, one offline vLLM engine (dummy, realistic or checkpoint weights), TPOT
  by the difference of two output lengths, one JSON result; ``--probe`` says
  what a Python can run (vLLM, plugins, flashinfer, device, the tables'
  stamps) without starting vLLM.
* ``weights``: the seeded realistic-weights recipe (pure, on any torch module
  tree) and its hook at the end of vLLM's dummy load.
* ``forced``: teacher-forced decoding through ``generate`` (vanilla #0's
  tokens, restarts after a differing one), run by the runner.
* ``tpot``: the token clock (per-token timestamps inside a generate) and the
  two TPOT figures side by side.
* ``agreement``: pure: every arm against vanilla, teacher-forced (greedy
  tokens, max |Δlogprob|, KL against vanilla's spread) and free-running.
* ``spec_decode``: ``--speculative``: the values, vLLM's speculative_config
  for them, the acceptance from vLLM's counters, the decode steps' M (a
  hook on the in-process scheduler) and the dispatch coverage at those M.
* ``first_token``: ``--first-token``: the time to first token on its own, per (prompt length, batch
  size), interleaved 1-token generates with fresh prompts in every process, and its figures: the ratio
  to vanilla over process pairs, vanilla's spread, a verdict against 2% that a noisy run cannot pass.
* ``settings``: what a run measures (``Settings``, checked before anything
  starts) and the model folder vLLM loads.
* ``bench``: the parent: arm schedule, environment per arm (``VLLM_PLUGINS``,
  ``TUNEKIT_TABLE``, dispatch logs), running and resuming, the report of a
  folder rebuilt from its files (``--report-only``).
* ``analysis``: pure: parse results, TPOT per arm, speedups, the tables'
  predicted saving, dispatch coverage, logprob agreement -> ``serve.json``
  (which names the run files under ``runs/`` and holds no copy of them).
* ``report``: ``serve.md`` and ``serve.png``.
* ``endpoint``: the same A/B against running OpenAI-compatible servers
  (streaming ``/v1/completions``, standard library only).
* ``provenance``: the package root the runners start with, its git commit.

Layers: ``weights``, ``forced``, ``tpot``, ``agreement``, ``profile``, ``spec_decode`` and ``first_token`` at the
bottom (standard library at import), ``runner`` on them, then ``analysis``,
``report``, ``provenance``, ``settings``, ``endpoint``, and ``bench`` on top.
"""

from __future__ import annotations

#: The arms, in the order every round runs them. ``tuned``: the tables with the fold off
#: (``TUNEKIT_FOLD_NORMS=0``); ``folded``: the plugin's default, the tables with the decoder norms folded into
#: their consumers where verified (``tunekit.integrations.vllm.fold``).
ARMS: tuple[str, ...] = ("vanilla", "passthrough", "tuned", "folded")
#: The arms a run takes unless told.
DEFAULT_ARMS: tuple[str, ...] = ("vanilla", "passthrough", "tuned")
#: The arms that serve the tables (their speedups over vanilla are reported, their dispatch logs read).
TABLE_ARMS: tuple[str, ...] = ("tuned", "folded")
