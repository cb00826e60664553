"""A push from memory, in process and without vLLM: the host store it rolls back to, and the
stream it writes from (``weight_bridge.direct.undo.HostStore``,
``weight_bridge.checkpoint.live``).

* The store is filled once, by the first push; after an update landed it catches up in the
  background, and the next push's pre-images are its tensors, not a copy.
* A push that fails mid-write is restored from the store bit for bit, whatever wrote before
  (another writer's write dates it out: the next push copies first).
* The write takes its tensors one at a time from the stream: a produced tensor is let go once
  the loader moved on (the read-back keeps rows of it, not it), so a push holds the tensors in
  flight, never the checkpoint.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import A, B, cold_start, load_by_name, snapshot_bytes

from weight_bridge.checkpoint.live import LiveCheckpoint, LiveTensor
from weight_bridge.direct import DirectReloadError, direct_reload, prepare_direct_reload
from weight_bridge.direct.state import undefined_reason
from weight_bridge.direct.undo import HostStore


def _push(model, tensors, store, load=None):
    """A push from memory as the worker makes it: described, then streamed."""
    live = LiveCheckpoint.of(tensors)
    prepared = prepare_direct_reload(
        model, list(live.tensors()), pre_images=store, stream=live.stream
    )
    return prepared.run(load)


def test_the_store_is_filled_once_then_caught_up_in_the_background() -> None:
    model = cold_start(A, lambda m: None)
    store = HostStore()
    _push(model, B, store)  # the first push copies A into the store
    hosts = {k: h.data_ptr() for k, (_, h) in store.copies.items()}
    assert store.nbytes == sum(t.nbytes for t in A.values())
    assert all(torch.equal(h, A[n]) for n, (_, h) in zip(A, store.copies.values(), strict=True))
    store.landed(model)  # B landed on every rank: copied in, off the push
    store.wait()
    assert all(torch.equal(h, B[n]) for n, (_, h) in zip(B, store.copies.values(), strict=True))
    assert store.current(model) == set(store.copies) and store.refresh_s > 0
    _push(model, A, store)  # its pre-images are the store's tensors: nothing allocated
    assert {k: h.data_ptr() for k, (_, h) in store.copies.items()} == hosts


@pytest.mark.parametrize("stale", [False, True], ids=["after-a-push", "after-another-writer"])
def test_a_failed_push_is_restored_from_the_store(stale: bool) -> None:
    model = cold_start(A, lambda m: None)
    store = HostStore()
    _push(model, B, store)
    store.landed(model)
    if stale:  # a file push, say: the store is not told, the write dates it
        direct_reload(model, A)
        assert not store.current(model)
    before = snapshot_bytes(model)

    def failing_load(weights) -> None:
        for i, (name, t) in enumerate(weights):
            if i == 1:
                raise OSError("injected: the trainer's tensor vanished")
            model.get_parameter(name).data.copy_(t) if "scale" not in name else None

    changed = {n: t + 1 for n, t in A.items()}
    with pytest.raises(DirectReloadError, match="restored from their pre-images"):
        _push(model, changed, store, failing_load)
    assert undefined_reason(model) is None and snapshot_bytes(model) == before


def test_the_write_holds_the_tensors_in_flight_not_the_checkpoint() -> None:
    """Each source produced only when the loader asks for it, and gone once it moved on."""
    model = cold_start(A, lambda m: None)
    alive: list[weakref.ref] = []
    in_flight: list[int] = []

    def fresh(t: torch.Tensor) -> torch.Tensor:  # a gather's output: a new tensor each time
        out = t.clone()
        alive.append(weakref.ref(out))
        return out

    def load(weights) -> None:
        for name, t in weights:
            gc.collect()
            in_flight.append(sum(ref() is not None for ref in alive))
            load_by_name(model, {name: t})

    items = [
        LiveTensor(n, tuple(t.shape), t.dtype, [t], lambda s: fresh(s[0])) for n, t in B.items()
    ]
    _push(model, items, HostStore(), load)
    assert len(alive) == len(B) and max(in_flight) <= 2, in_flight
    state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in B.items())
