"""Issue 62.4: every engine and bridge option is checked by type and value when the spec is
built, before anything starts, by one function (``weight_bridge.vllm.options.check_fields``),
on the trainer's side and where an engine reads its config; a refusal names the option and
what it allows. In mode ``serve`` a refused option starts no process, and a start that fails
after ``vllm serve`` was launched leaves no process of it behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from types import SimpleNamespace

import psutil
import pytest
import yaml
from helpers import SERVE_ARGS, engine_options_cli

from callbacks import EngineSpec
from callbacks.engine import EngineOptions, engine_of
from weight_bridge import WeightBridgeError
from weight_bridge.vllm.options import BridgeOptions, OptionError, bridge_options

BOOLEAN = "must be true or false (a boolean, not a string or a number)"
INFLIGHT = "must be one of 'recompute', 'keep', 'drain' or None"
POSITIVE = "must be a number > 0"

# (options, the option named, what it allows): each value YAML or a caller can give by mistake
HAZARDS = [
    ({"inflight": "dran"}, "inflight", INFLIGHT),
    ({"inflight": 7}, "inflight", INFLIGHT),
    ({"kv_cache_gb": "lots"}, "kv_cache_gb", POSITIVE + " or None"),
    ({"kv_cache_gb": -1}, "kv_cache_gb", POSITIVE + " or None"),
    ({"kv_cache_gb": True}, "kv_cache_gb", POSITIVE + " or None"),
    ({"cpu_threads_bind": [0, 1]}, "cpu_threads_bind", "must be a string or None"),
    ({"bridge": {"rollback": "false"}}, "rollback", BOOLEAN),
    ({"bridge": {"check_finite": "no"}}, "check_finite", BOOLEAN),
    ({"bridge": {"verify_hash": 2}}, "verify_hash", BOOLEAN),
    ({"engine_args": [["dtype", "float32"]]}, "engine_args", "must be a mapping"),
    ({"bridge": {"update_timeout_s": "120"}}, "update_timeout_s", POSITIVE),
    ({"bridge": {"update_timeout_s": -1}}, "update_timeout_s", POSITIVE),
    ({"bridge": {"readback": None}}, "readback", "must be one of 'sampled', 'full', 'off'"),
    ({"bridge": [1]}, "bridge", "must be a mapping"),
]


def _refused(make, name: str, allowed: str) -> OptionError:
    with pytest.raises(OptionError) as caught:
        make()
    assert isinstance(caught.value, WeightBridgeError) and isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert f"option {name}=" in message and allowed in message, message
    return caught.value


@pytest.mark.parametrize("options, name, allowed", HAZARDS, ids=lambda v: repr(v)[:40])
def test_a_bad_option_value_is_refused_when_the_spec_is_built(options, name, allowed) -> None:
    mode = "async" if "cpu_threads_bind" in options else "serve"  # where each one applies
    _refused(lambda: EngineSpec(model="m", mode=mode, options=options), name, allowed)
    _refused(lambda: EngineOptions(**options), name, allowed)


def test_a_mapping_read_from_yaml_keeps_its_strings_and_is_refused() -> None:
    """A YAML mapping loaded otherwise than by LightningCLI (``yaml.safe_load``) gives the
    callback ``"false"`` as a string: refused, not taken as true."""
    config = yaml.safe_load('model: m\nmode: serve\noptions: {bridge: {rollback: "false"}}')
    _refused(lambda: engine_of(config), "rollback", BOOLEAN)


@pytest.mark.parametrize(
    "options, name, allowed", [h for h in HAZARDS if isinstance(h[0].get("bridge"), dict)]
)
def test_the_engine_refuses_the_same_bridge_options_by_the_same_check(
    options, name, allowed
) -> None:
    """Where an engine reads its options (its ``additional_config``, JSON from the command
    line) and a trainer's per-session ``init_info``: the same refusal, by the same check."""
    raw = options["bridge"]
    config = SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="weight_bridge"),
        additional_config={"weight_bridge": raw},
    )
    _refused(lambda: bridge_options(config), name, allowed)
    _refused(lambda: BridgeOptions.from_dict(raw), name, allowed)
    _refused(lambda: BridgeOptions(**raw), name, allowed)
    if name != "update_timeout_s":  # fixed when the engine starts
        _refused(lambda: BridgeOptions().with_session(raw), name, allowed)


def test_good_values_pass_as_yaml_gives_them() -> None:
    spec = EngineSpec(
        model="m",
        mode="serve",
        options={
            "inflight": None,
            "kv_cache_gb": 1,  # an int is a number
            "bridge": {"rollback": False, "update_timeout_s": 30, "reload_mode": "auto"},
            "engine_args": {"dtype": "float32"},
        },
    )
    assert spec.args["kv_cache_gb"] == 1 and spec.args["rollback"] is False
    assert EngineSpec(model="m", mode="async", options={"cpu_threads_bind": "0|1"}).options
    assert BridgeOptions.from_dict({"readback": "off", "checkpoint_root": None}).readback == "off"


@pytest.mark.parametrize(
    "options, words",
    [
        ("{inflight: dran}", "engine option inflight='dran' is refused: inflight " + INFLIGHT),
        ("{inflight: 7}", "engine option inflight=7 is refused: inflight " + INFLIGHT),
        ("{kv_cache_gb: lots}", "kv_cache_gb='lots' is refused: kv_cache_gb " + POSITIVE),
        ("{kv_cache_gb: -1}", "is refused: kv_cache_gb " + POSITIVE),  # -1.0 by then
        ("{engine_args: [1]}", "engine_args=[1] is refused: engine_args must be a mapping"),
        ("{bridge: {verify_hash: 2}}", "bridge option verify_hash=2 is refused: verify_hash"),
        ("{bridge: {update_timeout_s: -1}}", "update_timeout_s=-1 is refused: update_timeout_s"),
    ],
)
def test_a_bad_value_in_yaml_fails_as_the_cli_parses_it(models, tmp_path, options, words) -> None:
    """Through LightningCLI, before any trainer or engine; the refusal is jsonargparse's
    ``ValueError`` carrying ours."""
    before = _children()
    with pytest.raises(ValueError, match=re.escape(words)):
        engine_options_cli(models["llama_A"], tmp_path, options)
    assert _children() - before == set()


def test_yaml_strings_reach_the_spec_as_what_they_mean_through_lightningcli(models, tmp_path):
    """jsonargparse reads a string under a mapping of ``Any`` as YAML: ``"false"``, ``"no"``
    and ``"120"`` arrive as ``False``, ``False`` and ``120`` (a mapping built otherwise, as by
    ``yaml.safe_load``, keeps the strings: refused above)."""
    options = '{bridge: {rollback: "false", check_finite: "no", update_timeout_s: "120"}}'
    (sync,) = [
        cb
        for cb in engine_options_cli(models["llama_A"], tmp_path, options).trainer.callbacks
        if hasattr(cb, "spec")
    ]
    assert sync.spec.options.bridge == {
        "rollback": False,
        "check_finite": False,
        "update_timeout_s": 120,
    }


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def cpu_engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_TARGET_DEVICE", "cpu")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_refused_option_in_mode_serve_starts_no_process(models, tmp_path, cpu_engine_env):
    """``ServedEngine``, ``start_engine`` and the spec each refuse before ``vllm serve`` is
    launched (before the fix ``ServedEngine`` started the server and its client refused the
    mode minutes later, the server and its engine core left running; the spec passed)."""
    from weight_bridge import ServedEngine, start_engine

    model, before = str(models["llama_A"]), _children()
    with pytest.raises(ValueError, match="inflight must be one of"):
        ServedEngine(model, inflight="dran", checkpoint_root=str(tmp_path))  # type: ignore[arg-type]
    assert _children() - before == set()
    with pytest.raises(OptionError, match="inflight must be one of"):
        start_engine(model, "serve", inflight="dran", checkpoint_root=str(tmp_path))
    _refused(lambda: start_engine(model, "serve", rollback="false"), "rollback", BOOLEAN)
    spec = {"model": model, "mode": "serve", "options": {"inflight": "dran"}}
    _refused(lambda: EngineSpec(**spec), "inflight", INFLIGHT)
    assert _children() - before == set()


class _Interrupted(Exception):
    pass


@pytest.mark.slow
def test_a_server_that_fails_after_its_launch_is_stopped_with_its_engine_core(
    models, tmp_path, cpu_engine_env
) -> None:
    """A real fault in the start path after ``vllm serve`` was launched: a signal to this
    process (as a Ctrl-C would be) once the server's engine core runs, raising in the wait
    for ``/health``. The error leaves; the server and its engine core have ended first."""
    from weight_bridge.vllm.clients.served import VLLMServer

    options = BridgeOptions(checkpoint_root=str(tmp_path))
    log = tmp_path / "serve.log"
    server = VLLMServer(models["llama_A"], options, SERVE_ARGS, log=log)
    engine_core: list[int] = []
    done = threading.Event()

    def interrupt_once_the_engine_core_runs() -> None:
        while not done.wait(0.2):
            process = server.process
            for child in psutil.Process(process.pid).children(True) if process else []:
                with contextlib.suppress(psutil.Error):
                    if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
                        engine_core.append(child.pid)
            if engine_core:
                os.kill(os.getpid(), signal.SIGUSR1)
                return

    def raise_interrupted(*_: object) -> None:
        raise _Interrupted

    before, previous = _children(), signal.signal(signal.SIGUSR1, raise_interrupted)
    watcher = threading.Thread(target=interrupt_once_the_engine_core_runs, daemon=True)
    try:
        watcher.start()
        with pytest.raises(_Interrupted):
            server.start()
        assert engine_core, log.read_text(errors="replace")[-3000:]
        assert server.process is None and not _alive(engine_core)
        assert _children() - before == set()
    finally:
        done.set()
        watcher.join(10)
        signal.signal(signal.SIGUSR1, previous)
        for pid in [*(_children() - before), *engine_core]:  # what the code before the fix left
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def _alive(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        return False

    return any(alive(pid) for pid in pids)
