"""A bit-exact fingerprint of a tensor that can be updated in O(changed elements).

Why: a delta checkpoint is only correct on exactly the bits it was diffed against. The trainer
records, for every tensor a delta touches, the fingerprint of the *full* tensor it produces;
the engine, which never sees the full tensor again, proves it holds those bits by updating the
fingerprint of what it served with the elements it changed (their pre-images are read anyway,
for the undo log). Drift anywhere in the chain (a lost write, a rounding that differs, a delta
applied on other bits) shows as a mismatch.

The fingerprint is linear over positions, modulo 2**64::

    fp(t) = sum_i bits(t[i]) * w(i)        with w(i) = A[i mod 65536] * B[i // 65536], odd

where ``bits`` is the element's raw bit pattern as a signed integer (a bf16 is its int16), and
an 8-byte element (float64, int64) counts as its two 4-byte halves, low then high, at positions
``2i`` and ``2i + 1``: weighted whole, a flip of its top bit would change the sum by ``2**63 *
w(i)``, which is ``2**63`` for every odd weight, so any two such flips cancelled (and two flips
of bit 62 half the time); as halves, two flips cancel only where two weights agree in their
low 33 bits. Since every ``w(i)`` is odd, changing any one element always changes the
fingerprint, and
``fp(new) = fp(old) + sum over changed i of (new_i - old_i) * w(i)``. It is a check against
mistakes, not an adversary. Torch's int64 arithmetic wraps, and wrapping addition is associative
and commutative, so the order of the sums (threads, devices, chunks) does not matter.
"""

from __future__ import annotations

import torch

_LOW = 1 << 16
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROWS = 64  # rows of 65536 elements widened to int64 at a time (32 MiB)
_CHANGE_BLOCK = 1 << 18  # changed elements weighed at a time (int64 temporaries of 2 MiB)
_A: dict[torch.device, torch.Tensor] = {}
_B: dict[torch.device, torch.Tensor] = {}  # B[0:n] for the largest n asked so far


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 over int64 (wrapping arithmetic, logical shifts), made odd."""
    x = x + 0x1E3779B97F4A7C15  # an int64 constant: the golden ratio's, top bit cleared
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x | 1


def _low_weights(device: torch.device) -> torch.Tensor:
    a = _A.get(device)
    if a is None:
        a = _splitmix(torch.arange(_LOW, dtype=torch.int64, device=device))
        _A[device] = a
    return a


def _high_weights(first: int, count: int, device: torch.device) -> torch.Tensor:
    """``B[first:first + count]``, from a table kept per device (a tensor of n elements has
    n / 65536 of them, so the table stays small; hashing each changed element's high part
    instead costs a dozen int64 passes)."""
    b = _B.get(device)
    if b is None or b.numel() < first + count:
        size = max(first + count, 2 * (b.numel() if b is not None else 0), 1024)
        b = _splitmix(torch.arange(size, dtype=torch.int64, device=device) + _LOW)
        _B[device] = b
    return b[first : first + count]


def weights_at(indices: torch.Tensor) -> torch.Tensor:
    """``w(i)`` for each flat index (int64): two table look-ups."""
    if not indices.numel():
        return torch.empty(0, dtype=torch.int64, device=indices.device)
    high = _high_weights(0, int(indices.max()) // _LOW + 1, indices.device)
    return _low_weights(indices.device)[indices & (_LOW - 1)] * high[indices >> 16]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Each element's raw bits as a signed integer tensor of the same size (a view)."""
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _words(bits: torch.Tensor) -> torch.Tensor:
    """The integers the fingerprint weighs, one row per element (flattened: their positions):
    an 8-byte element's two int32 halves (low, high: little-endian), any other element
    itself."""
    if bits.element_size() == 8:
        return bits.reshape(-1).view(torch.int32).view(-1, 2)
    return bits.reshape(-1, 1)


@torch.no_grad()
def exact_fingerprint(t: torch.Tensor) -> int:
    """The fingerprint of all of ``t`` (row-major), an unsigned 64-bit integer; one pass, a
    bounded int64 temporary, on the tensor's device."""
    flat = _words(bits_of(t.detach().reshape(-1))).reshape(-1)
    n = flat.numel()
    low = _low_weights(flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    block = _ROWS * _LOW
    for start in range(0, n, block):
        part = flat[start : start + block].to(torch.int64)
        rows = -(-part.numel() // _LOW)
        padded = torch.nn.functional.pad(part, (0, rows * _LOW - part.numel()))
        per_row = (padded.view(rows, _LOW) * low).sum(dim=1)
        total += (per_row * _high_weights(start // _LOW, rows, flat.device)).sum()
    return int(total) & ((1 << 64) - 1)


@torch.no_grad()
def fingerprint_change(indices: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """``fp(after) - fp(before)`` (mod 2**64) when the elements at flat ``indices`` change from
    ``old`` to ``new`` (same dtype): O(changed)."""
    total = 0
    new, old, indices = new.reshape(-1), old.reshape(-1), indices.reshape(-1)
    for start in range(0, indices.numel(), _CHANGE_BLOCK):  # bounded int64 temporaries
        end = start + _CHANGE_BLOCK
        new_words, old_words = _words(bits_of(new[start:end])), _words(bits_of(old[start:end]))
        diff = new_words.to(torch.int64) - old_words.to(torch.int64)  # one row per element
        at = indices[start:end].to(torch.int64)
        per = diff.shape[1]  # words per element: their positions per * i + k
        if per > 1:
            at = (at.reshape(-1, 1) * per + torch.arange(per, device=at.device)).reshape(-1)
        total += int((diff.reshape(-1) * weights_at(at)).sum())
    return total & ((1 << 64) - 1)


def format_fingerprint(value: int) -> str:
    """How a fingerprint is written in a header: 16 hex digits."""
    return f"{value & ((1 << 64) - 1):016x}"
