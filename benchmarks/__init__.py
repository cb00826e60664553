"""The weight-bridge benchmark harness (``python -m benchmarks``; not installed): the harness,
the engines and the sections of ``__main__.REGISTRY`` (docs/benchmarks.md describes each)."""
