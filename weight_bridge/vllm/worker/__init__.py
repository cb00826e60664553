"""Runs in every vLLM worker (each tensor-parallel rank): the backend, the transaction, what is
recorded at load, the refreshers of derived state."""
