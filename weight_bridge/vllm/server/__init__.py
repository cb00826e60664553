"""Runs where vLLM's ``LLM`` / ``AsyncLLM`` object lives (the API server of ``vllm serve``, or the
trainer for an in-process engine): typed errors from vLLM's RL calls, the results route."""
