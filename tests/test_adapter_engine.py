"""An adapter pushed into a running engine's LoRA slots serves what a cold start serves.

The reference is a cold start: a fresh engine with LoRA enabled on the same base and a
``LoRARequest`` on the same PEFT directory (vLLM's own load). The engine under test starts on
the base with no adapter; the bridge pushes the PEFT directories v1 then v2 (in place, into
the slots); each version then has the cold start's slot bits (every row of its slot,
fingerprinted exactly), greedy tokens and logprobs, and stays resident and exact after the next
push and across ``finish_weight_update`` (which in stock vLLM drops every adapter). With two
slots, a third version retires the oldest; a version evicted from its slot comes back from the
CPU copy the push registered, with the same bits. fp32 and bf16 engines (bf16: B's scaling
rounds). Refusals write nothing; a failure after the slot was written restores it all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import close_engine, lora_greedy, open_engine, run_script
from safetensors.torch import load_file, save_file

from weight_bridge import DirectReloadError
from weight_bridge.testing.adapters import build_peft_adapter
from weight_bridge.testing.models import build_tiny_model
from weight_bridge.vllm.errors import AdapterVersionError

pytestmark = [pytest.mark.slow, pytest.mark.every_vllm]

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
PROMPTS = ["hello world", "the quick brown fox", "a b c d"]
FIRST_ID = 1 << 30  # the bridge's first version id (weight_bridge.vllm.internals.lora)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-engine")
    base = build_tiny_model(root / "llama", arch="llama", seed=0)
    out = {"base": base}
    out["v1"] = build_peft_adapter(base, root / "v1", seed=1)
    out["v2"] = build_peft_adapter(base, root / "v2", seed=2, rank_pattern={"v_proj": 4})
    out["v3"] = build_peft_adapter(base, root / "v3", seed=3, targets=("q_proj", "down_proj"))
    return out


def sample(engine, request) -> list[tuple[list[int], list[float]]]:
    return lora_greedy(engine, PROMPTS, request)


def hf_logprobs(
    base: Path, adapter: Path, prompts: list[list[int]], outputs: list[list[int]]
) -> list[list[float]]:
    """The logprob of each generated token under PEFT's merged model (fp32, Hugging Face)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + tokens[:-1]])
            logprobs = merged(ids).logits[0].log_softmax(-1)[len(prompt) - 1 :]
            out.append([float(logprobs[i, t]) for i, t in enumerate(tokens)])
    return out


def request(name: str, lora_id: int, path: Path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, str(path))


def adapters(engine) -> dict:
    (answer,) = engine._rpc("adapters")  # one worker
    return answer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cold_start_reference(files: dict[str, Path], dtype: str) -> None:
    from vllm import SamplingParams

    # the reference: vLLM's own load of each PEFT directory, in a fresh engine
    cold = open_engine(files["base"], key=("cold", dtype), dtype=dtype, **LORA)
    want, want_prints = {}, {}
    for i, v in enumerate(("v1", "v2", "v3"), start=1):
        want[v] = sample(cold, request(f"cold-{v}", i, files[v]))
        want_prints[v] = adapters(cold)["prints"][str(i)]
        if v == "v2":  # two slots: make room for v3
            cold.llm.llm_engine.remove_lora(1)
    base_tokens = sample(cold, None)
    close_engine()
    # not vacuous: each version samples its own tokens and fills its slot with its own bits
    assert len({str(x) for x in (*want.values(), base_tokens)}) == 4
    assert len({str(p) for p in want_prints.values()}) == 3

    engine = open_engine(files["base"], key=("bridged", dtype), dtype=dtype, **LORA)
    assert sample(engine, None) == base_tokens
    one = SamplingParams(max_tokens=1)
    ids = {}
    for n, v in enumerate(("v1", "v2"), start=0):
        report = engine.push(files[v], version=v)
        assert report.mode == "adapter"
        state = adapters(engine)
        ids[v] = FIRST_ID + n
        assert ids[v] in state["registered"], state  # kept across finish_weight_update
        assert state["prints"][str(ids[v])] == want_prints[v]
    assert adapters(engine)["slots"] == [ids["v1"], ids["v2"]]
    for v in ("v1", "v2"):  # both resident, each exactly its cold start
        got = sample(engine, request(f"policy@{v}~{ids[v]}", ids[v], files[v]))
        assert got == want[v], v
        if dtype == "float32":  # and PEFT's own merged model, in Hugging Face, agrees
            prompts = [
                o.prompt_token_ids for o in engine.llm.generate(PROMPTS, one, use_tqdm=False)
            ]
            hf = hf_logprobs(files["base"], files[v], prompts, [t for t, _ in got])
            worst = max(
                abs(a - b)
                for (_, lps), ref in zip(got, hf, strict=True)
                for a, b in zip(lps, ref, strict=True)
            )
            print(f"{v}: logprobs within {worst:.1e} of PEFT's merged model in HF")
            assert worst < 1e-5, (v, worst)
    assert adapters(engine)["prints"][str(ids["v1"])] == want_prints["v1"]
    assert sample(engine, None) == base_tokens  # the base untouched
    # the client samples with the newest version unless one is named; each token is labelled
    # with the version that sampled it, and the engine's label still names the base weights
    assert by_client(engine) == (want["v2"], {"v2"})
    assert by_client(engine, "v1") == (want["v1"], {"v1"})
    assert by_client(engine, "base") == (base_tokens, {None})  # the base weights, by name
    assert engine.llm.get_weight_version() == "default"
    base_outputs = engine.llm.generate(PROMPTS, one, use_tqdm=False)
    assert {s.version for o in base_outputs for s in o.outputs[0].weight_versions} == {"default"}

    engine.push(files["v3"], version="v3")  # two slots: v1, the oldest, leaves
    state = adapters(engine)
    ids["v3"] = FIRST_ID + 2
    assert state["slots"] == [ids["v3"], ids["v2"]] and ids["v1"] not in state["registered"]
    assert state["prints"][str(ids["v3"])] == want_prints["v3"]
    assert sample(engine, request(f"policy@v3~{ids['v3']}", ids["v3"], files["v3"])) == want["v3"]
    assert sample(engine, request(f"policy@v2~{ids['v2']}", ids["v2"], files["v2"])) == want["v2"]
    assert by_client(engine) == (want["v3"], {"v3"})
    with pytest.raises(AdapterVersionError, match="'v1' is not resident .*'v2', 'v3'"):
        engine.generate(PROMPTS, version="v1")

    # evicted, its slot scribbled over, then asked for: vLLM re-fills the slot from the CPU
    # copy the push registered, which must hold the version's bits too
    (slot,) = engine.llm.collective_rpc(evict_and_scribble, args=(ids["v2"],))
    assert adapters(engine)["slots"][slot] is None
    assert sample(engine, request(f"policy@v2~{ids['v2']}", ids["v2"], files["v2"])) == want["v2"]
    assert adapters(engine)["prints"][str(ids["v2"])] == want_prints["v2"]
    close_engine()


def test_every_entry_point_samples_the_newest_version(files: dict[str, Path]) -> None:
    """A multi-process ``vllm.LLM`` and an ``AsyncLLM`` (engine core, workers and front end in
    separate processes): the client samples with the newest version unless one is named, exactly
    as a cold start on it, each token labelled with its version, the engine's label the base's;
    a version never pushed is refused by name; a push that would take the slot of a version a
    request still computes with is refused by name."""
    cold = open_engine(files["base"], key=("cold", "float32"), dtype="float32", **LORA)
    want = {v: sample(cold, request(v, i, files[v])) for i, v in enumerate(("v1", "v2"), 1)}
    cold.llm.llm_engine.remove_lora(1)  # two slots: make room for v3
    want["v3"] = sample(cold, request("v3", 3, files["v3"]))
    close_engine()
    root = str(files["base"].parent)
    paths = (str(files[v]) for v in ("base", "v1", "v2", "v3"))
    result = run_script("adapter_check.py", root, *paths)
    for engine in result[0]["engines"]:
        assert engine["mode_v1"] == engine["mode_v2"] == "adapter"
        for key, version in (("newest", "v2"), ("v1", "v1")):
            got = [(tokens, logprobs) for tokens, logprobs, _ in engine[key]]
            assert got == [(t, lp) for t, lp in want[version]], key
            assert {tuple(labels) for _, _, labels in engine[key]} == {(version,)}, key
        assert engine["label"] == "default"
        assert "'v0' is not resident" in engine["gone"]
    # an AsyncLLM generating with v1 while v3 would take v1's slot: refused by name, nothing
    # written (the generation ends on v1's bits, labelled so); pushed again once it ended
    in_use = result[0]["engines"][1]["in_use"]
    assert "'v1' would leave its LoRA slot, but 1 request(s)" in in_use["refused"], in_use
    assert in_use["running_versions"] == ["v1"] and list(in_use["after"]) == ["v2", "v3"]
    assert [(t, lp) for t, lp, _ in in_use["newest_after"]] == [(t, lp) for t, lp in want["v3"]]


def by_client(engine, version: str | None = None) -> tuple[list, set]:
    """What the bridge's client samples (``version`` None: the newest), as :func:`sample`
    gives it, and the labels of its tokens."""
    sampling = dict(max_tokens=8, temperature=0.0, logprobs=1)
    out = [g.completions[0] for g in engine.generate(PROMPTS, sampling, version=version)]
    return [(c.token_ids, c.logprobs) for c in out], {v for c in out for v in c.versions}


def evict_and_scribble(worker, lora_id: int) -> int:
    """In the worker: take ``lora_id`` out of its slot (vLLM's own deactivation, unpinned
    first) and fill the slot's rows with garbage; the slot it held."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slot = manager.lora_index_to_id.index(lora_id)
    manager._active_adapters.pinned_items.discard(lora_id)
    manager.deactivate_adapter(lora_id)
    for module in manager.modules.values():
        for stacked in (module.lora_a_stacked, module.lora_b_stacked):
            for part in stacked if isinstance(stacked, (tuple, list)) else (stacked,):
                part[slot].fill_(7.0)
    return slot


def test_adapter_refusals_write_nothing(files: dict[str, Path], tmp_path: Path) -> None:
    """NaN in B, a rank above ``max_lora_rank``, an engine without LoRA: refused by name,
    nothing written (slots, CPU copies, ids unchanged)."""
    nan = tmp_path / "nan"
    shutil.copytree(files["v1"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors", metadata={"format": "pt"})
    wide = build_peft_adapter(files["base"], tmp_path / "wide", seed=5, r=16, alpha=16)

    engine = open_engine(files["base"], key=("bridged", "float32"), dtype="float32", **LORA)
    engine.push(files["v1"], version="v1")
    before = adapters(engine)
    assert before["registered"] == [FIRST_ID], before  # kept across the push's own finish
    with pytest.raises(DirectReloadError) as info:
        engine.push(nan, version="nan")
    assert info.value.problems == {
        name.replace(
            "lora_B", "lora_A"
        ): "NaN or Inf in A or B once cast to torch.float32 and scaled"
    }
    with pytest.raises(DirectReloadError, match="exceeds the engine's max_lora_rank 8"):
        engine.push(wide, version="wide")
    assert adapters(engine) == before
    # a refused push of base weights (nothing written) keeps the adapters: vLLM would drop them
    # at the update's end, and a request would then reload the slot from its PEFT directory
    with pytest.raises(DirectReloadError):
        engine.push(files["base"], version="base")
    assert adapters(engine) == before

    plain = open_engine(files["base"], key=("plain", "float32"), dtype="float32")
    with pytest.raises(DirectReloadError, match="not started with enable_lora=True"):
        plain.push(files["v1"], version="v1")
    close_engine()


def test_failure_mid_write_restores_everything(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the slot was written (the oldest version already retired from it):
    the slot's bits, the retired version's CPU copy, pin and slot, every id, all as before;
    both resident versions sample as before; the next push succeeds."""
    from weight_bridge.vllm.internals import lora

    engine = open_engine(files["base"], key=("bridged", "float32"), dtype="float32", **LORA)
    for v in ("v1", "v2"):
        engine.push(files[v], version=v)
    before = adapters(engine)
    first, second = before["slots"]
    tokens = {
        i: sample(engine, request(f"policy@{v}~{i}", i, files[v]))
        for i, v in ((first, "v1"), (second, "v2"))
    }
    activate = lora.activate

    calls = []

    def fails_after_writing(manager, copy):  # the write's call only, not its undo's
        calls.append(copy.id)
        slot = activate(manager, copy)
        if len(calls) == 1:
            raise RuntimeError("injected after the slot was written")
        return slot

    monkeypatch.setattr(lora, "activate", fails_after_writing)
    with pytest.raises(DirectReloadError, match="injected after the slot was written") as info:
        engine.push(files["v3"], version="v3")
    monkeypatch.undo()
    assert "the slot and the adapters were restored" in str(info.value)
    assert calls == [first + 2, first]  # v3 written, then v1 re-activated by the undo
    after = adapters(engine)
    assert after == before
    for i, v in ((first, "v1"), (second, "v2")):
        assert sample(engine, request(f"policy@{v}~{i}", i, files[v])) == tokens[i]
    engine.push(files["v3"], version="v3")
    assert first not in adapters(engine)["registered"]
    close_engine()
