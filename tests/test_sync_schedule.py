"""The sync clock on its own (no trainer): which steps sync, and which syncs may be partial.

The same rules run under a real ``Trainer`` in ``test_callback.py`` and ``test_partial_sync.py``;
here each rule is walked step by step.
"""

from __future__ import annotations

from callbacks import Schedule
from callbacks.schedule import SyncClock


def pushed(clock: SyncClock, step: int, partial: bool) -> None:
    """What the callback's sender tells the clock of a successful sync of ``step``."""
    clock.last_pushed_step = step
    clock.pushed(partial)


def test_cadence_counts_advanced_due_steps_once() -> None:
    clock = SyncClock(Schedule(every_n_train_steps=3, at_steps=(4,)))
    assert clock.at_train_start(0)  # the engine serves the trainer's weights first
    synced = []
    for step in [0, 1, 1, 2, 3, 3, 4, 5, 6]:  # a repeated step: gradient accumulation
        if clock.at_batch_end(step):
            pushed(clock, step, False)
            synced.append(step)
    assert synced == [3, 4, 6]
    assert not clock.at_train_end(6)  # already pushed
    assert clock.at_train_end(7)
    assert clock.at_train_start(5)  # a resumed run too


def test_partial_after_a_complete_sync_until_full_every_k_or_a_failure() -> None:
    clock = SyncClock(Schedule(full_every_k=3))
    clock.at_train_start(0)
    kinds = []
    for step in range(8):
        partial = clock.partial_due()
        kinds.append("P" if partial else "C")
        if step == 4:
            clock.failed()
            continue
        pushed(clock, step, partial)
    # every third complete; the sync after the failed one (step 4) complete, and counted anew
    assert "".join(kinds) == "CPPCP" + "CPP"
    clock.at_train_start(9)
    assert not clock.partial_due()  # a new run starts complete


def test_skip_frozen_off_is_always_complete() -> None:
    clock = SyncClock(Schedule(skip_frozen=False))
    clock.at_train_start(0)
    for step in range(3):
        assert not clock.partial_due()
        pushed(clock, step, False)
