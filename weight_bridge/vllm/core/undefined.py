"""A bridged engine core while a rank's weights are undefined (a failed update that could not be
rolled back): it schedules nothing and ends every request at once with the reason, until a
complete update succeeds (:mod:`.updates` sets and clears the state)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import undefined_message
from ..internals.engine_core import (
    finish_every_request,
    pause_scheduling,
    set_pause_state,
    unpause_scheduling,
)
from ..internals.objects import config_of
from ..options import is_bridged
from .state import BridgeCoreState, core_state

_logger = logging.getLogger(__name__)


def stop_scheduling(core: Any, state: BridgeCoreState, why: str) -> None:
    before = pause_scheduling(core)  # running requests preempted, no cached KV kept
    # ...and unpaused again, so that the core's loop steps: each step is then
    # failing_while_undefined's, which schedules nothing and ends every request
    unpause_scheduling(core)
    if state.undefined is None:
        state.paused_before = before
    state.undefined = why
    _logger.error(
        "weight_bridge: the engine's weights are undefined (%s); nothing is scheduled until a "
        "complete update succeeds",
        why,
    )


def resume_if_paused(core: Any, state: BridgeCoreState) -> None:
    if state.undefined is None:
        return
    state.undefined = None
    set_pause_state(core, state.paused_before)


def failing_while_undefined(step: Any) -> Any:
    """``EngineCore.step`` (and ``step_with_batch_queue``): while a rank's weights are
    undefined, one step finishes every request the scheduler holds with vLLM's ``error``
    finish reason and :func:`undefined_message` as its ``stop_reason``, and runs no model.

    The scheduler is left unpaused so that the core's loop steps at all: paused, each step
    would return nothing while the requests stay, ``vllm.LLM.generate`` would spin at full CPU
    and ``AsyncLLM`` and ``vllm serve`` would wait, forever. A request that arrives later ends at
    the next step the same way."""

    def wrapped(self, *args, **kwargs):
        undefined = core_state(self).undefined  # only ever set on a bridged core
        if undefined is None:
            return step(self, *args, **kwargs)
        return finish_every_request(self, undefined_message(undefined)), False

    return wrapped


def releasing_resume(resume: Any) -> Any:
    """``resume_scheduler`` while a rank's weights are undefined: the pause it was asked to end
    is released, nothing more. The scheduler keeps ending every request with the reason
    (:func:`failing_while_undefined`), and the complete update that repairs the engine leaves
    it unpaused. Refusing the resume instead kept the pause of a push that paused and then
    failed: the engine stayed paused after its repair, every request waiting."""

    def resume_scheduler(self, *args, **kwargs):
        state = core_state(self) if is_bridged(config_of(self)) else None
        if state is None or state.undefined is None:
            return resume(self, *args, **kwargs)
        state.paused_before = unpause_scheduling(self)  # a pause taken while undefined, too
        return None

    return resume_scheduler
