"""A real ``vllm serve`` process with the ``weight_bridge`` backend, driven over HTTP.

One server per model family (a tied dense Qwen2, and Qwen3-MoE with the CPU experts prepack),
started once for the module on A, under a checkpoint root of its own. Every reference is a
cold start of a *stock* ``vllm.LLM`` (no bridge) on the same checkpoint: greedy tokens and
top-3 logprobs to 1e-4. Updates go through vLLM's own RL routes (``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/pause``, ``/resume``) with
:class:`~weight_bridge.vllm.clients.http.HTTPClient`; generation through the token-in/token-out
route ``/inference/v1/generate``, streamed where a push must land mid-generation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from faults import FAULT_FILE_ENV, FAULTS, slowed
from helpers import (
    LABEL_PROMPTS,
    LABEL_TOKENS,
    PROMPTS,
    SERVE_ARGS,
    assert_differs,
    assert_labels_name_weights,
    assert_parity,
    assert_recompute_continues,
    delta_checkpoint,
    engine_cast,
    label_colds,
    pushes_under_load,
)

from weight_bridge import HTTPClient, RemoteUpdateError
from weight_bridge.checkpoint import (
    BASE_VERSION_KEY,
    CheckpointError,
    CheckpointReader,
    save_checkpoint,
)
from weight_bridge.delta.format import FINGERPRINTS_KEY
from weight_bridge.direct import DirectReloadError
from weight_bridge.direct.errors import BaseVersionError
from weight_bridge.testing import parity
from weight_bridge.vllm.clients.served import VLLMServer
from weight_bridge.vllm.errors import EngineUndefinedError, UpdateInProgressError
from weight_bridge.vllm.options import BridgeOptions
from weight_bridge.vllm.plugin import PLUGINS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SERVER_ARGS = [  # a 70-token prompt fills two cacheable blocks of 32
    *SERVE_ARGS,
    "--chat-template",  # the tiny models have none: the openai package's chat needs one
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
]
LONG = 96  # tokens of a generation a push lands in the middle of
UPDATE_TIMEOUT_S = 4.0  # the servers' update_timeout_s: a dead trainer's update is abandoned


def http_greedy(client: HTTPClient, prompts=PROMPTS, max_tokens: int = 12, **extra) -> list:
    """:func:`helpers.greedy` over HTTP: greedy tokens and top-3 logprobs per prompt (the
    same :func:`weight_bridge.testing.parity.greedy` as in process)."""
    return parity.greedy(client, prompts, max_tokens=max_tokens, logprobs=3, **extra)


class Streams:
    """Greedy generations streamed from the server in threads: how many tokens each has so far,
    and, once finished, its tokens and ``weight_versions``."""

    def __init__(self, client: HTTPClient, prompts: list[list[int]], max_tokens: int = LONG):
        self.seen = {i: 0 for i in range(len(prompts))}
        self.out: dict[int, tuple[list[int], list[dict]]] = {}
        self.errors: list[BaseException] = []
        self.headers = {"Content-Type": "application/json"}
        if client.api_key:
            self.headers["Authorization"] = f"Bearer {client.api_key}"
        self.threads = [
            threading.Thread(target=self._run, args=(client.url, i, p, max_tokens), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, ids: list[int], max_tokens: int) -> None:
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        body = {"token_ids": ids, "sampling_params": sampling, "stream": True}
        request = urllib.request.Request(
            f"{url}/inference/v1/generate", json.dumps(body).encode(), self.headers
        )
        tokens: list[int] = []
        spans: list[dict] = []
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[5:])["choices"][0]
                    tokens += choice.get("token_ids") or []
                    spans = choice.get("weight_versions") or spans
                    self.seen[i] = len(tokens)
        except BaseException as exc:
            self.errors.append(exc)
        self.out[i] = (tokens, spans)

    def wait_for(self, tokens: int, timeout_s: float = 300.0) -> dict[int, int]:
        """Block until every stream has at least ``tokens`` tokens; how many each has."""
        deadline = time.monotonic() + timeout_s
        while min(self.seen.values()) < tokens:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"streams stalled at {self.seen}"
            time.sleep(0.002)
        return dict(self.seen)

    def ended(self, grace_s: float = 2.0) -> set[int]:
        """The streams whose generation has ended, given ``grace_s`` for a last chunk in flight.
        While the engine is paused with ``keep`` no generation can end, so a stream still open
        after the grace is held mid-generation."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(t.is_alive() for t in self.threads):
            time.sleep(0.01)
        return {i for i, t in enumerate(self.threads) if not t.is_alive()}

    def join(self) -> dict[int, tuple[list[int], list[dict]]]:
        for t in self.threads:
            t.join(600)
        assert not self.errors, self.errors
        return self.out


def _start(
    root: Path, model: Path, log: Path, fault: Path, api_key: str | None = None
) -> VLLMServer:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    env.update({PLUGINS_ENV: FAULTS, FAULT_FILE_ENV: str(fault)})  # inert while no file
    options = BridgeOptions(checkpoint_root=str(root), update_timeout_s=UPDATE_TIMEOUT_S)
    server = VLLMServer(model, options, SERVER_ARGS, env=env, log=log, api_key=api_key)
    return server.start()


def _served(api_models, family: str, api_key: str | None = None):
    """A server on ``family``'s A, under the shared root (which also takes the tests' files);
    its pushes fail after writing while the file ``fault`` exists (FAULT INJECTION:
    ``tests/faults.py``)."""
    root, models = api_models
    a, b = models[family]
    fault = root.parent / f"fault-{family}"
    server = _start(root, a, root.parent / f"serve-{family}.log", fault, api_key)
    client = HTTPClient(server.url, api_key=api_key, inflight=None)
    yield {"root": root, "a": a, "b": b, "client": client, "key": api_key, "fault": fault}
    server.stop()


@pytest.fixture(scope="module")
def dense(api_models):
    """A server on a tied dense Qwen2 (A)."""
    yield from _served(api_models, "dense")


@pytest.fixture(scope="module")
def moe(api_models):
    """A server on Qwen3-MoE (A): the CPU experts prepack refreshed after each push; started
    with an API key, required on every route (``weight_bridge.vllm.server.middleware``)."""
    yield from _served(api_models, "moe", api_key="moe-secret")


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(model) as reader:
        return {name: t.clone() for name, t in reader.tensors()}


def _refused(client: HTTPClient, path: Path | str) -> DirectReloadError | CheckpointError:
    """The typed error of a refused push over HTTP (as in process), the server's answer its
    cause."""
    with pytest.raises((DirectReloadError, CheckpointError)) as info:
        client.push(path, version="never")
    assert isinstance(info.value.__cause__, RemoteUpdateError), info.value
    return info.value


# -- issue 20: the backend under vllm serve -----------------------------------------------------


@pytest.mark.every_vllm
def test_http_push_equals_a_stock_cold_start_and_refusals_keep_the_served_version(
    dense, stock_cold
) -> None:
    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    cold_a = http_greedy(client)
    assert_parity(cold_a, stock_cold(a))
    report = client.push(b, version="b1")
    assert client.weight_version() == "b1"
    # The same report as in-process, from the workers' own answer (the results route).
    assert report.mode == "direct" and report.version == "b1" and report.verified_writes > 0
    assert report.tensors == len(_tensors(b)) and report.served == [str(b.resolve())]
    served = http_greedy(client)
    assert_parity(served, stock_cold(b))
    assert_differs(served, cold_a)

    tensors = _tensors(b)
    name = sorted(tensors)[5]
    nan = {**tensors, name: torch.full_like(tensors[name], float("nan"))}
    save_checkpoint(nan, root / "nan.safetensors")
    shape = {**tensors, name: tensors[name][:-1].clone()}
    save_checkpoint(shape, root / "shape.safetensors")
    # another tool's digest under the bridge's fingerprint key: parsed at prepare, refused by
    # name (it was parsed after the write: new bits under the old label, an untyped 500)
    malformed = {FINGERPRINTS_KEY: json.dumps({name: "not-hex-digest!!"})}
    save_checkpoint(_tensors(a), root / "malformed.safetensors", malformed)
    cases = (
        ("nan.safetensors", "NaN"),
        ("shape.safetensors", "shape"),
        ("malformed.safetensors", "not 16 hex digits"),
    )
    for bad, words in cases:
        error = _refused(client, root / bad)
        assert error.__cause__.status == 400 and words in error.problems[name], error
        assert client.weight_version() == "b1"
        assert_parity(http_greedy(client), served)


def test_a_refusal_is_the_same_typed_error_in_process_and_over_http(dense, engine_factory) -> None:
    """The same bad checkpoints pushed into the server and into an in-process engine on the
    same model and root: the same type, message and ``.problems`` (one function rebuilds them
    from the engine core's outcome), the server's HTTP answer the cause over HTTP."""
    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    tensors = _tensors(b)
    name = sorted(tensors)[5]
    save_checkpoint({**tensors, name: tensors[name][:-1].clone()}, root / "both-shape.safetensors")
    raw = (b / "model.safetensors").read_bytes()
    (root / "both-truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    bad = ("both-shape.safetensors", "both-truncated.safetensors")
    over_http = [_refused(client, root / f) for f in bad]
    engine = engine_factory(a, checkpoint_root=str(root))
    in_process = []
    for f in bad:
        with pytest.raises((DirectReloadError, CheckpointError)) as info:
            engine.push(root / f, version="never")
        in_process.append(info.value)
    assert [type(e) for e in over_http] == [DirectReloadError, CheckpointError]
    assert "shape" in over_http[0].problems[name]
    for here, there in zip(in_process, over_http, strict=True):
        assert type(here) is type(there) and str(here) == str(there)
        assert here.problems == there.problems


def test_paths_the_engine_must_not_read_are_refused_by_name(dense, tmp_path_factory) -> None:
    """Only under the root fixed at start: not outside it, not through a symlink or ``..``,
    not a file another user owns or could write."""
    client, root, b = dense["client"], dense["root"], dense["b"]
    version = client.weight_version()
    outside = tmp_path_factory.mktemp("outside") / "w.safetensors"
    shutil.copy(b / "model.safetensors", outside)
    link = root / "link.safetensors"
    link.symlink_to(outside)
    writable = root / "writable.safetensors"
    shutil.copy(b / "model.safetensors", writable)
    writable.chmod(0o664)
    cases = [
        (outside, "outside the engine's checkpoint root"),
        (link, "outside the engine's checkpoint root"),
        (f"{root}/../{outside.parent.name}/w.safetensors", "outside the engine's checkpoint root"),
        (writable, "writable by its group or by others"),
    ]
    if os.geteuid() == 0:  # CI runs as root: a file of another user can be made
        foreign = root / "foreign.safetensors"
        shutil.copy(b / "model.safetensors", foreign)
        os.chown(foreign, 65534, 65534)
        cases.append((foreign, "not by the engine's user"))
    elif os.environ.get("CI"):
        pytest.fail("CI must run as root: the case of a file another user owns was left out")
    for path, words in cases:
        error = _refused(client, path)
        assert words in str(error), (path, error)
    assert client.weight_version() == version


@pytest.mark.every_vllm
def test_a_partial_checkpoint_over_http_needs_its_exact_base(dense, stock_cold, tmp_path) -> None:
    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    client.push(b, version="base")
    full, changed = _tensors(b), _tensors(a)
    part = {n: t for n, t in changed.items() if ".layers.1." in n}
    save_checkpoint(part, root / "part.safetensors", {BASE_VERSION_KEY: "base"})
    save_checkpoint(part, root / "wrong.safetensors", {BASE_VERSION_KEY: "elsewhere"})
    error = _refused(client, root / "wrong.safetensors")
    assert "'elsewhere'" in str(error) and "'base'" in str(error)
    assert client.weight_version() == "base"
    client.push(root / "part.safetensors", version="part")
    assert client.served_checkpoints == [str(b.resolve()), str(root / "part.safetensors")]
    merged = root / "merged"
    shutil.copytree(a, merged, ignore=shutil.ignore_patterns("*.safetensors"))
    save_checkpoint({**full, **part}, merged / "model.safetensors")
    assert_parity(http_greedy(client), stock_cold(merged))


def test_a_prefix_cached_before_a_push_is_not_served_after_it(dense, stock_cold) -> None:
    """vLLM's own updates leave the prefix cache as it was; the bridge's do not."""
    client, a, b = dense["client"], dense["a"], dense["b"]
    long = [[1, *range(40, 110)]]  # two full 32-token blocks and a bit
    client.push(a, version="a")
    on_a = http_greedy(client, long)  # fills the prefix cache with A's KV
    client.push(b, version="b")
    on_b = http_greedy(client, long)
    assert_parity(on_b, stock_cold(b, long))
    assert_differs(on_b, on_a)


@pytest.mark.every_vllm
def test_code_written_for_vllms_trainer_api_pushes_through_the_bridge(dense, stock_cold) -> None:
    """vLLM's trainer side, unchanged: ``WeightTransferTrainerFactory.trainer_init`` with the
    bridge's init info, vLLM's own HTTP client, vLLM's ``ModuleSource`` over a module."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weight_bridge.vllm.clients.trainer_api import (
        IncompleteSourceError,
        WeightBridgeTrainerInitInfo,
    )

    client, b, root = dense["client"], dense["b"], dense["root"]
    model = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    sender = WeightTransferTrainerFactory.trainer_init(
        WeightBridgeTrainerInitInfo(directory=str(root / "trainer-api"), rank=0),
        client=HTTPVLLMWeightSyncClient(client.url),
        source=ModuleSource(model),  # Hugging Face names; the tied lm_head is yielded once
    )
    sent = sender.send_weights(version="from-trainer-api")
    assert client.weight_version() == "from-trainer-api"
    assert_parity(http_greedy(client), stock_cold(b))
    # the one push routine's report, and the served chain as the engine answered it
    report = sender.last_report
    assert report is not None and report.version == "from-trainer-api" and report.paused_s is None
    assert report.served == [str(sent)] and report.verified_writes > 0

    norm = model.model.norm.weight  # a wrong-shaped tensor: refused, typed, naming it
    model.model.norm.weight = torch.nn.Parameter(norm.detach()[:-1].clone())
    # vLLM 0.32's source declares the new shape and the engine refuses the checkpoint; 0.33+'s
    # caches its metadata, so the trainer refuses the tensor it yields before writing a file
    with pytest.raises((DirectReloadError, IncompleteSourceError)) as refused:
        sender.send_weights(version="never")
    assert "shape" in refused.value.problems["model.norm.weight"], refused.value
    if isinstance(refused.value, DirectReloadError):
        assert isinstance(refused.value.__cause__, RemoteUpdateError)
    assert client.weight_version() == "from-trainer-api"
    assert sender.last_version == "from-trainer-api" and sender.last_report is report
    assert_parity(http_greedy(client), stock_cold(b))


def test_a_restarted_trainer_never_reuses_a_name_of_the_served_chain(dense, stock_cold) -> None:
    """vLLM's trainer API against a long-lived server: a trainer sends a complete checkpoint
    and a partial on top of it; a restarted trainer on the same directory counts on past both
    names, so no file of the server's chain is ever replaced (issue 37). The server then equals
    a stock cold start on the restarted trainer's weights."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weight_bridge.vllm.clients.trainer_api import WeightBridgeTrainerInitInfo

    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    info = WeightBridgeTrainerInitInfo(directory=str(root / "restarted"), rank=0)

    def sender(model_dir: Path):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        source = ModuleSource(model)
        return WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(client.url), source=source
        )

    first = sender(a)
    chain = [first.send_weights(version="r1")]
    chain.append(first.send_weights(version="r1p", names=["model.norm.weight"]))
    again = sender(b)  # the trainer restarted: its own count starts at 1
    sent = again.send_weights(version="r2")
    assert sent is not None and sent.name == "step-00000003.safetensors"
    assert sent not in chain
    assert client.weight_version() == "r2"
    assert_parity(http_greedy(client), stock_cold(b))
    client.push(a, version="A")


def test_the_callback_pushes_into_a_server_by_url(dense, stock_cold) -> None:
    """A real ``Trainer`` with ``VLLMWeightSync(engine=EngineSpec(url=...))``: after training,
    the server serves exactly the trainer's weights (a stock cold start on them), its version
    the step."""
    from helpers import TinyLM, model_dir_with, trainer

    from callbacks import CheckpointFiles, EngineSpec, Schedule, VLLMWeightSync

    client, a, root = dense["client"], dense["a"], dense["root"]
    sync = VLLMWeightSync(
        engine=EngineSpec(url=client.url, options={"inflight": None}),
        schedule=Schedule(every_n_train_steps=2),
        files=CheckpointFiles(dirpath=str(root / "callback-checkpoints")),
    )
    module = TinyLM(str(a), lr=0.05)
    trainer(root / "callback-run", [sync], max_steps=4).fit(module)
    assert client.weight_version() == "4" and sync.engine is not None
    state = {n: t.detach().clone() for n, t in module.model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied: the checkpoint holds the embedding once
    trained = model_dir_with(a, state, root / "callback-trained")
    assert_parity(http_greedy(client), stock_cold(trained))


def test_an_undefined_server_answers_every_request_at_once_with_the_reason(
    dense, stock_cold
) -> None:
    """Issue 47.7: after a push fails past its first write with rollback off (FAULT INJECTION,
    ``tests/faults.py``: a refresh that raises; nothing can be sent into a
    served worker), each generate request is answered at once with 503 and the reason, not
    vLLM's bare 500: over raw HTTP, through the ``openai`` package and ``HTTPClient``
    (:class:`EngineUndefinedError`); a complete push repairs the engine."""
    import openai

    client, a, b, fault = dense["client"], dense["a"], dense["b"], dense["fault"]
    client.push(a, version="A")
    client.call("init_weight_transfer_engine", {"init_info": {"rollback": False}})
    fault.touch()
    try:
        with pytest.raises(DirectReloadError, match="injected fault"):
            client.push(b, version="never", inflight="keep")  # its pause released
    finally:
        fault.unlink()
        client.call("init_weight_transfer_engine", {"init_info": {"rollback": True}})
    started = time.monotonic()
    model = client.call("v1/models", method="GET")["data"][0]["id"]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}
    request = urllib.request.Request(
        f"{client.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(raw.value.read())["error"]
    assert raw.value.code == 503 and error["type"] == "EngineUndefinedError", error
    assert "weights are undefined" in error["message"] and "injected fault" in error["message"]
    sdk = openai.OpenAI(base_url=f"{client.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as answered:
        sdk.completions.create(model=model, prompt=[1, 2, 3], max_tokens=4)
    assert answered.value.status_code == 503 and "injected fault" in str(answered.value)
    with pytest.raises(EngineUndefinedError, match="injected fault"):
        http_greedy(client)
    assert time.monotonic() - started < 60  # nobody waited for a timeout
    client.push(a, version="A")
    assert not client.call("is_paused", method="GET")["is_paused"]  # the failed push's pause
    assert_parity(http_greedy(client), stock_cold(a))


@pytest.mark.every_vllm
def test_the_moe_family_over_http(moe, stock_cold) -> None:
    client, a, b = moe["client"], moe["a"], moe["b"]
    version = client.weight_version()
    for key in (None, "wrong"):  # vLLM's --api-key alone would let these through
        intruder = HTTPClient(client.url, api_key=key, inflight=None)
        intruder.api_key = key  # not even $VLLM_API_KEY
        with pytest.raises(RemoteUpdateError) as info:
            intruder.push(b, version="intruder")
        assert info.value.status == 401
        with pytest.raises(RemoteUpdateError, match="401"):
            intruder.call("collective_rpc", {"method": "get_model"})
    assert client.weight_version() == version
    assert_parity(http_greedy(client), stock_cold(a))
    client.push(b, version="1")
    assert_parity(http_greedy(client), stock_cold(b))


# Every route of vLLM's that changes weights, pauses or sleeps generation, or reaches the
# workers, and the bridge's own: vLLM's --api-key guards none of them.
RL_ROUTES = (
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"),
    ("GET", "/get_world_size"),
    ("GET", "/weight_info"),
    ("POST", "/weight_checker"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("GET", "/weight_bridge/results"),
    ("POST", "/weight_bridge/pause?mode=wait"),
)


def _status(url: str, method: str, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@pytest.mark.every_vllm
def test_every_rl_route_answers_401_without_the_key(moe) -> None:
    """A server started with an API key (``VLLMServer(api_key=...)``: vLLM's ``--api-key``
    and the bridge's results middleware alone, which checks the key itself): every RL,
    development and bridge route answers ``401`` to a request with no key or a wrong one, and
    nothing changed; with the key the same middleware lets a request through (a read-only
    route answers ``200``). Without dev mode, and the middlewares in either order:
    ``tests/test_serve_keys.py``."""
    client = moe["client"]
    version = client.weight_version()
    for method, route in RL_ROUTES:
        for key in (None, "wrong"):
            assert _status(client.url + route, method, key) == 401, (method, route, key)
    assert _status(client.url + "/is_paused", "GET", client.api_key) == 200
    assert _status(client.url + "/weight_bridge/results", "GET", client.api_key) == 200
    assert client.weight_version() == version


# -- issue 21: pushes while generations are in flight ------------------------------------------


def _inflight_prompts() -> list[list[int]]:
    return [[1, 20, 21, 22], [1, 5, 9, 30, 31], [1, 100, 101]]


def _held_streams(served: dict, prompts: list[list[int]]) -> tuple[Streams, set[int]]:
    """Streams of ``prompts`` stopped mid-generation with vLLM's own ``/pause`` (``keep``,
    caches kept) once each has 4 tokens, and which of them ended before the pause took hold.
    Until the pause, the engine is slowed (FAULT INJECTION: ``tests/faults.py``, a loaded
    machine on purpose, 50 ms a step): on CI's loaded machine the streams' last 92 tokens came
    before a push paused them (three tries in a row), and once before even ``/pause`` did.
    A stream that ended anyway (one begun late) is judged as ended; at least one must be held.
    The push's own pause (clearing the caches, or not) and its resume then do what they
    always do."""
    client = served["client"]
    with slowed(served["fault"]):
        streams = Streams(client, prompts)
        streams.wait_for(4)
        client.call("pause?mode=keep&clear_cache=false")
    ended = streams.ended()
    assert len(ended) < len(prompts), f"every generation ended before the pause: {streams.seen}"
    return streams, ended


def _assert_ended_on(out: dict, ended: set[int], version: str) -> None:
    """The streams in ``ended`` generated all :data:`LONG` tokens under ``version``."""
    for i in ended:
        tokens, spans = out[i]
        assert [s["version"] for s in spans] == [version] and len(tokens) == LONG, (i, spans)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_recompute_continues_every_sequence_with_the_new_policy(
    family, request, stock_cold
) -> None:
    """Mid-generation push with ``recompute``: each output has exactly two spans covering all
    its tokens, and its tokens after the update are what a stock cold start on the new
    checkpoint generates from the prompt plus the tokens before the update."""
    served = request.getfixturevalue(family)
    client, a, b = served["client"], served["a"], served["b"]
    prompts = _inflight_prompts()
    client.push(a, version="old")
    streams, ended = _held_streams(served, prompts)
    report = client.push(b, version="new", inflight="recompute")
    out = streams.join()
    assert report.paused_s is not None and report.inflight == "recompute"
    _assert_ended_on(out, ended, "old")
    held = [i for i in range(len(prompts)) if i not in ended]
    outputs = [(out[i][0], [(s["version"], s["start"], s["end"]) for s in out[i][1]]) for i in held]
    assert_recompute_continues([prompts[i] for i in held], outputs, b, stock_cold, LONG)


@pytest.mark.every_vllm
def test_keep_and_drain_and_a_refused_push_in_flight(dense, stock_cold) -> None:
    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    prompts = _inflight_prompts()
    client.push(a, version="k0")
    streams, ended = _held_streams(dense, prompts)
    client.push(b, version="k1", inflight="keep")
    out = streams.join()
    _assert_ended_on(out, ended, "k0")
    for i, (tokens, spans) in out.items():
        if i not in ended:
            assert [s["version"] for s in spans] == ["k0", "k1"], (i, spans)
            assert spans[-1]["end"] == len(tokens) == LONG, (i, spans, len(tokens))

    client.push(a, version="d0")
    streams = Streams(client, prompts)
    streams.wait_for(4)
    report = client.push(b, version="d1", inflight="drain")
    for tokens, spans in streams.join().values():  # finished before the update
        assert [s["version"] for s in spans] == ["d0"] and len(tokens) == LONG
    assert report.paused_s is not None

    client.push(a, version="r0")
    tensors = _tensors(b)
    name = sorted(tensors)[2]
    save_checkpoint(
        {**tensors, name: torch.full_like(tensors[name], float("inf"))}, root / "inf.safetensors"
    )
    streams = Streams(client, prompts)
    streams.wait_for(4)
    with pytest.raises(DirectReloadError, match=name):
        client.push(root / "inf.safetensors", version="r1", inflight="recompute")
    want = stock_cold(a, prompts, max_tokens=LONG, ignore_eos=True)
    for i, (tokens, spans) in streams.join().items():  # every sequence finished on r0
        assert [s["version"] for s in spans] == ["r0"]
        assert tokens == want[i][0]
    assert client.weight_version() == "r0"


# -- issue 27: every token's label names the weights that produced it ---------------------------


def _http_labelled(client: HTTPClient):
    def generate(ids: list[int]) -> tuple[list[int], list[tuple[str, int, int]]]:
        sampling = {"max_tokens": LABEL_TOKENS, "temperature": 0.0, "ignore_eos": True}
        completion = client.generate([ids], sampling)[0].completions[0]
        spans = [(str(s.version), s.start, s.end) for s in completion.spans]
        return completion.token_ids, spans

    return generate


@pytest.mark.parametrize("inflight", [None, "keep", "recompute", "drain", "raw"])
def test_every_label_names_the_weights_under_concurrent_generation(
    dense, stock_cold, inflight
) -> None:
    """Four threads generate without a break while A and B are pushed alternately: each output
    under one version is that version's stock cold start, and every output's spans are
    contiguous and cover its tokens, whatever the in-flight mode (``None``: no pause at all;
    ``raw``: vLLM's three routes with no pause and no version in ``update_info``, so the engine
    labels the write with the checkpoint's name until ``finish_weight_update`` renames it)."""
    client, a, b = dense["client"], dense["a"], dense["b"]
    cold = label_colds(a, b, stock_cold)
    cold |= {a.name: cold["A"], b.name: cold["B"]}  # the engine's default label: the file name
    client.push(a, version="A")

    def push(path: Path, version: str) -> None:
        if inflight != "raw":
            client.push(path, version=version, inflight=inflight)
            return
        client.call("start_weight_update")
        client.call("update_weights", {"update_info": {"checkpoint": str(path)}})
        client.call("finish_weight_update", {"weight_version": version})

    outputs = pushes_under_load(_http_labelled(client), push, {"B": b, "A": a}, pushes=12)
    assert_labels_name_weights(outputs, cold)
    assert client.weight_version() == "A"


@pytest.mark.parametrize(
    "inflight", [pytest.param(None, marks=pytest.mark.every_vllm), "recompute"]
)
def test_deltas_over_http_label_every_token_and_a_wrong_base_is_refused(
    dense, stock_cold, inflight
) -> None:
    """Deltas A->B and B->A (O(changed) writes, made in the engine's dtype as its complete
    push reported) pushed alternately over HTTP while four threads generate: each output under
    one version is that version's stock cold start. A delta on another base than the served
    version is refused by type, naming both versions, and changes nothing."""
    client, a, b, root = dense["client"], dense["a"], dense["b"], dense["root"]
    cold = label_colds(a, b, stock_cold)
    full = client.push(a, version="A")
    assert full.dtypes
    ta = engine_cast(_tensors(a / "model.safetensors"), full.dtypes)
    tb = engine_cast(_tensors(b / "model.safetensors"), full.dtypes)
    ab = delta_checkpoint(ta, tb, "A", "B", root / f"delta-{inflight}-ab.safetensors")
    ba = delta_checkpoint(tb, ta, "B", "A", root / f"delta-{inflight}-ba.safetensors")
    deltas: list[bool] = []

    def push(path: Path, version: str) -> None:
        deltas.append(client.push(path, version=version, inflight=inflight).delta)

    outputs = pushes_under_load(_http_labelled(client), push, {"B": ab, "A": ba}, pushes=8)
    assert deltas == [True] * 8
    assert_labels_name_weights(outputs, cold)
    with pytest.raises(BaseVersionError) as info:
        client.push(ba, version="never")
    assert "version 'B'" in str(info.value) and "version 'A'" in str(info.value)
    assert client.weight_version() == "A"
    generate = _http_labelled(client)
    assert [generate(ids)[0] for ids in LABEL_PROMPTS] == [c[0] for c in cold["A"]]


def test_two_pushers_one_update_at_a_time_and_a_dead_trainer_is_abandoned(
    dense, stock_cold
) -> None:
    """A trainer that took the update and paused generation holds it: a second pusher gets 409
    (UpdateInProgressError, since when, which version) and neither pauses nor resumes anything;
    pushers racing at once: each round one wins or they take turns, and the served label names
    the served weights. A trainer killed between its update and its finish leaves its weights
    under their own label; the next push is refused until ``update_timeout_s`` passed, then
    works."""
    client, a, b = dense["client"], dense["a"], dense["b"]
    cold = label_colds(a, b, stock_cold)
    generate = _http_labelled(client)
    client.push(a, version="A")
    first = HTTPClient(client.url, inflight=None)
    first.call("start_weight_update")
    first.call("pause?mode=keep&clear_cache=false")
    started = time.monotonic()
    with pytest.raises(UpdateInProgressError) as refused:
        client.push(b, version="B", inflight="recompute")
    assert "a weight update is active since" in str(refused.value), refused.value
    assert "stack trace" not in str(refused.value)
    assert client.call("is_paused", method="GET")["is_paused"]  # the refused push resumed nothing
    first.call("update_weights", {"update_info": {"checkpoint": str(b), "version": "B"}})
    with pytest.raises(UpdateInProgressError, match="of version 'B'"):
        client.push(a, version="A", inflight=None)
    first.call("finish_weight_update", {"weight_version": "B"})
    first.call("resume")
    assert time.monotonic() - started < UPDATE_TIMEOUT_S  # refused for holding, not expired
    assert client.weight_version() == "B"
    assert [generate(ids)[0] for ids in LABEL_PROMPTS] == [c[0] for c in cold["B"]]

    outcomes: list[str] = []
    for _ in range(4):
        barrier = threading.Barrier(2)

        def race(path: Path, version: str, barrier: threading.Barrier = barrier) -> None:
            racer = HTTPClient(client.url, inflight=None)
            barrier.wait()
            try:
                racer.push(path, version=version)
                outcomes.append(f"won {version}")
            except UpdateInProgressError:
                outcomes.append("409")

        racers = [threading.Thread(target=race, args=arg) for arg in ((a, "A"), (b, "B"))]
        for t in racers:
            t.start()
        for t in racers:
            t.join(120)
        label = client.weight_version()
        assert [generate(ids)[0] for ids in LABEL_PROMPTS] == [c[0] for c in cold[label]]
    assert len(outcomes) == 8 and all(o.startswith("won") or o == "409" for o in outcomes)
    assert "409" in outcomes, outcomes

    dead = (
        "import sys; from weight_bridge.vllm.clients.http import HTTPClient; import os, signal\n"
        "c = HTTPClient(sys.argv[1]); c.call('start_weight_update')\n"
        "c.call('update_weights', {'update_info': {'checkpoint': sys.argv[2], 'version': 'A'}})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    trainer = subprocess.run([sys.executable, "-c", dead, client.url, str(a)], timeout=120)
    assert trainer.returncode == -signal.SIGKILL
    died = time.monotonic()
    assert client.weight_version() == "A"  # stamped with the write, no finish needed
    assert [generate(ids)[0] for ids in LABEL_PROMPTS] == [c[0] for c in cold["A"]]
    with pytest.raises(UpdateInProgressError, match="abandoned if it makes no call within"):
        client.push(b, version="B")
    while True:
        try:
            client.push(b, version="B")
            break
        except UpdateInProgressError:
            assert time.monotonic() - died < UPDATE_TIMEOUT_S + 5.0
            time.sleep(0.2)
    assert time.monotonic() - died >= UPDATE_TIMEOUT_S - 0.5
    assert client.weight_version() == "B"
    assert [generate(ids)[0] for ids in LABEL_PROMPTS] == [c[0] for c in cold["B"]]


@pytest.mark.every_vllm
def test_no_client_of_the_server_fails_during_pushes_in_any_mode(dense, stock_cold) -> None:
    """Issue 50.1: other clients of a served engine never see a push. Six threads ask without a
    break, each its own way: the ``openai`` package's completions and chat (``max_retries=0``:
    a 503 would be an error), each streamed and not, raw HTTP, and ``HTTPClient``; meanwhile
    B and A are pushed in every in-flight mode (``drain`` pauses through the bridge's route,
    which queues what arrives, where vLLM 0.33+'s ``/pause?mode=wait`` answers 503). No request
    fails, every way was served during the pushes, and the engine ends on A."""
    import openai

    client, a, b = dense["client"], dense["a"], dense["b"]
    client.push(a, version="A")
    model = client.call("v1/models", method="GET")["data"][0]["id"]
    sdk = openai.OpenAI(base_url=f"{client.url}/v1", api_key="unused", max_retries=0)
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    }
    text = {"model": model, "prompt": [1, 2, 3], "max_tokens": 8}
    raw = urllib.request.Request(
        f"{client.url}/v1/completions",
        json.dumps(text).encode(),
        {"Content-Type": "application/json"},
    )
    ways = {
        "openai completions": lambda: sdk.completions.create(**text),
        "openai completions streamed": lambda: list(sdk.completions.create(**text, stream=True)),
        "openai chat": lambda: sdk.chat.completions.create(**chat),
        "openai chat streamed": lambda: list(sdk.chat.completions.create(**chat, stream=True)),
        "raw HTTP": lambda: urllib.request.urlopen(raw, timeout=120).read(),
        "HTTPClient": lambda: client.generate([[1, 2, 3]], {"max_tokens": 8}),
    }
    for way in ways.values():
        way()  # each works before any push
    stop = threading.Event()
    served = dict.fromkeys(ways, 0)
    errors: list[str] = []

    def ask(name: str) -> None:
        while not stop.is_set():
            try:
                ways[name]()
            except Exception as exc:
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                return
            served[name] += 1

    threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in ways]
    for t in threads:
        t.start()
    try:
        for inflight in (None, "keep", "recompute", "drain"):
            for path, version in ((b, "B"), (a, "A")):
                client.push(path, version=version, inflight=inflight)
                time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert all(count > 0 for count in served.values()), served
    assert client.weight_version() == "A"
    assert not client.call("is_paused", method="GET")["is_paused"]


@pytest.mark.every_vllm
def test_the_engine_holds_the_trainers_bits_after_every_kind_of_push(dense, tmp_path) -> None:
    """Issue 50.3, through the bridge's fingerprints (vLLM 0.32 has no ``/weight_checker``; on
    0.34 its checksums hash live parameters a trainer cannot compute): after a complete, a
    partial and a delta push, and after a failed push rolled back (FAULT INJECTION:
    ``tests/faults.py``), the engine holds exactly the trainer's tensors
    (``weight_mismatches`` is empty); after a deliberately wrong push (one tensor not the
    trainer's) the check names that tensor and no other."""
    from weight_bridge.vllm.clients.checks import weight_mismatches

    client, a, b, root, fault = (
        dense["client"],
        dense["a"],
        dense["b"],
        dense["root"],
        dense["fault"],
    )
    ta, tb = _tensors(a / "model.safetensors"), _tensors(b / "model.safetensors")
    report = client.push(a, version="A")
    assert weight_mismatches(client, ta, report.dtypes) == {}
    assert set(weight_mismatches(client, tb, report.dtypes)) == set(ta)  # every tensor differs
    part = {n: t for n, t in tb.items() if ".layers.1." in n}
    save_checkpoint(part, root / "checked-part.safetensors", {BASE_VERSION_KEY: "A"})
    client.push(root / "checked-part.safetensors", version="A+")
    assert weight_mismatches(client, {**ta, **part}, report.dtypes) == {}
    ca, cb = engine_cast(ta, report.dtypes), engine_cast(tb, report.dtypes)
    client.push(a, version="A")  # a keyframe for the delta
    delta = delta_checkpoint(ca, cb, "A", "B", root / "checked-delta.safetensors")
    assert client.push(delta, version="B").delta
    assert weight_mismatches(client, tb, report.dtypes) == {}
    fault.write_text("once")  # the push fails after writing; its rollback re-writes B's chain
    try:
        with pytest.raises(DirectReloadError, match="rolled back"):
            client.push(a, version="never")
    finally:
        fault.unlink(missing_ok=True)
    assert client.weight_version() == "B" and weight_mismatches(client, tb, report.dtypes) == {}
    name = next(n for n in ta if n.endswith("mlp.down_proj.weight"))
    wrong = dict(ta)
    wrong[name] = wrong[name] + 0.5
    save_checkpoint(wrong, root / "checked-wrong.safetensors")
    client.push(root / "checked-wrong.safetensors", version="A?")
    problems = weight_mismatches(client, ta, report.dtypes)
    assert list(problems) == [name], problems
    assert problems[name].startswith("rank 0 holds fingerprint "), problems  # one worker
