"""host/runtime/digest.py: the parallel weight digests (with each buffer's length) are a function of the bytes alone (not of
the number of threads or of how buffers are batched), and each piece is hashed as hashlib does."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host.runtime import digest


def _reference(data: bytes, chunk: int) -> bytes:
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] or [b""]
    return b"".join(hashlib.sha256(p).digest() for p in pieces)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=0, max_size=12), chunk=st.integers(1, 64),
       batch=st.integers(1, 500), workers=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_digests_are_the_pieces_sha256_whatever_the_threads_and_batches(sizes, chunk, batch, workers, seed):
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(digest, "CHUNK", chunk)
        mp.setattr(digest, "BATCH", batch)
        mp.setattr(digest, "threads", lambda: workers)
        got = list(digest.buffer_digests(iter(buffers)))
    assert got == [(len(b), _reference(b, chunk)) for b in buffers]


def test_a_buffer_is_any_bytes_like_object():
    """NumPy arrays and memoryviews hash their bytes, as bytes do."""
    arr = np.arange(1000, dtype=np.float32)
    (a, b, c) = digest.buffer_digests([arr, memoryview(arr.tobytes()), arr.tobytes()])
    assert a == b == c == (arr.nbytes, _reference(arr.tobytes(), digest.CHUNK))
