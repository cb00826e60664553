"""Adapter versions over a real ``vllm serve`` process, by model name.

One server for the module, started on a tiny Llama with two LoRA slots; the bridge pushes PEFT
adapters v1, v2, v3 over HTTP. The reference is a cold start: a fresh engine with LoRA enabled
on the same base and a ``LoRARequest`` on each version's PEFT directory (vLLM's own load),
greedy: the same tokens and top-3 ids, logprobs within float32 noise. The served name samples
with the newest version, ``NAME@VERSION`` with a resident one, ``NAME@base`` with the base
weights; every token comes back labelled with the version that sampled it; a version that left
its slot is refused by name and no longer listed (``weight_bridge.vllm.server.middleware``).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import SERVE_ARGS, close_engine, open_engine

from weight_bridge import HTTPClient
from weight_bridge.testing import parity
from weight_bridge.testing.adapters import build_peft_adapter
from weight_bridge.testing.models import build_tiny_model
from weight_bridge.vllm.clients.served import VLLMServer
from weight_bridge.vllm.errors import AdapterVersionError
from weight_bridge.vllm.generation import policy_label
from weight_bridge.vllm.options import BridgeOptions

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm, pytest.mark.timeout(900)]

SERVED = "policy"
LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "logprobs": 3}
# tokens and top-3 ids exact; logprobs to float32 noise: the server batches requests as they
# come and runs its own threads, which changes reduction orders (measured: up to ~1e-6)
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-adapters")
    base = build_tiny_model(root / "llama", arch="llama", seed=0)
    out = {"root": root, "base": base}
    for seed, version in enumerate(("v1", "v2", "v3"), start=1):
        out[version] = build_peft_adapter(base, root / version, seed=seed)
    return out


@pytest.fixture(scope="module")
def cold(files: dict[str, Path]) -> dict[str, list]:
    """Greedy tokens and top-3 logprobs of a fresh LoRA engine: v1 and v2 from their PEFT
    directories (vLLM's own load), and the base."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from weight_bridge.vllm.clients.llm import token_prompts

    engine = open_engine(files["base"], key="serve-adapters-cold", **LORA)

    def sample(lora: LoRARequest | None) -> list:
        params = SamplingParams(**SAMPLING)
        prompts = token_prompts(parity.PROMPTS)
        return parity.collect(
            engine.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        )

    out = {
        v: sample(LoRARequest(f"cold-{v}", i, str(files[v]))) for i, v in enumerate(("v1", "v2"), 1)
    }
    out["base"] = sample(None)
    close_engine()
    tokens = {json.dumps([t for t, _ in x]) for x in out.values()}
    assert len(tokens) == 3  # not vacuous: each samples its own tokens
    return out


@pytest.fixture(scope="module")
def client(files: dict[str, Path]) -> Iterator[HTTPClient]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    options = BridgeOptions(checkpoint_root=str(files["root"]))
    args = [*SERVE_ARGS, *LORA_ARGS, "--served-model-name", SERVED]
    with VLLMServer(files["base"], options, args, env=env) as server:
        yield HTTPClient(server.url, inflight=None)


def listed(client: HTTPClient) -> set[str]:
    with urllib.request.urlopen(f"{client.url}/v1/models", timeout=30) as response:
        return {card["id"] for card in json.load(response)["data"]}


def sample(client: HTTPClient, version: str | None = None) -> tuple[list, set[str | None]]:
    """Greedy outputs over HTTP, and the labels of all their tokens."""
    outs = client.generate(parity.PROMPTS, SAMPLING, version=version)
    return parity.collect(outs), {v for g in outs for v in g.completions[0].versions}


def assert_serves(got: tuple[list, set[str | None]], want: list, labels: set) -> None:
    """``got`` (:func:`sample`) is ``want``'s greedy outputs, every token labelled ``labels``."""
    same = parity.check_parity(got[0], want, tol=LOGPROB_TOL)
    print(f"logprobs within {same.max_logprob_diff:.1e} of the cold start")
    assert same.match, same.problems
    assert got[1] == labels


def test_adapter_versions_are_served_by_name(
    files: dict[str, Path], cold: dict[str, list], client: HTTPClient
) -> None:
    base_label = policy_label(client.weight_version())  # "default": None, the initial weights
    assert listed(client) == {SERVED, f"{SERVED}@base"}
    assert_serves(sample(client), cold["base"], {base_label})  # no adapter yet: the base

    for version in ("v1", "v2"):
        report = client.push(files[version], version=version)
        assert report.mode == "adapter", report
    assert list(report.adapters) == ["v1", "v2"]
    assert listed(client) == {SERVED, f"{SERVED}@base", f"{SERVED}@v1", f"{SERVED}@v2"}
    # the served name is the newest version; each resident version by its name, as its cold
    # start; every token labelled with the version that sampled it
    assert_serves(sample(client), cold["v2"], {"v2"})
    assert_serves(sample(client, "v1"), cold["v1"], {"v1"})
    assert_serves(sample(client, "v2"), cold["v2"], {"v2"})
    assert_serves(sample(client, "base"), cold["base"], {base_label})  # the engine's own label
    assert policy_label(client.weight_version()) == base_label  # the base was not relabelled

    client.push(files["v3"], version="v3")  # two slots: v1, the oldest, leaves
    with pytest.raises(AdapterVersionError, match="'v1' is not resident.*'v2', 'v3'"):
        client.generate(parity.PROMPTS, SAMPLING, version="v1")
    assert listed(client) == {SERVED, f"{SERVED}@base", f"{SERVED}@v2", f"{SERVED}@v3"}
    assert sample(client)[1] == {"v3"}
    assert_serves(sample(client, "v2"), cold["v2"], {"v2"})
