"""The weight-bridge benchmark suite (``python -m benchmarks``; not part of the installed library).

* :mod:`benchmarks.__main__`: the command line, one size end to end, the results JSON;
* :mod:`benchmarks.config`: sizes, engine arguments, parity prompts, targets;
* :mod:`benchmarks.machine`: CPU, memory, versions, load and per-process memory from ``/proc``;
* :mod:`benchmarks.worker`: the worker extension whose methods time the limits and vLLM's reloads
  inside the engine's worker process;
* :mod:`benchmarks.measure`: the measurements on live engines, in-process and in a child process;
* :mod:`benchmarks.save`: ``save_checkpoint`` against a raw write of the same bytes;
* :mod:`benchmarks.stats`: statistics, round-robin runs, ratios, targets, correctness;
* :mod:`benchmarks.report` and :mod:`benchmarks.plot`: the markdown tables and the figure.
"""
