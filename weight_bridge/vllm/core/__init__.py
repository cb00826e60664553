"""Runs in vLLM's engine-core process: each update a transaction over every rank."""
