"""com.microsoft MatMulNBits' packing of low-bit codes, shared by the CPU kernel
(host/cpu_ep/ops_quant_nbits.py) and the optimizer rule that writes it (host/optimizer/rules/qdq_nbits.py):
codes of `bits` bits (2, 4 or 8), 8 // bits to a byte, the first code in the low bits."""

from __future__ import annotations

import numpy as np


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The `count` unsigned codes of each row of packed bytes (last axis), low bits first."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    if bits == 8:
        return packed[..., :count]
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of unpack_codes along the last axis (padded with zero codes to whole bytes)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.shape[-1] % per_byte
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1)
    groups = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(np.uint32)
    shifts = np.arange(per_byte, dtype=np.uint32) * bits
    return (groups << shifts).sum(axis=-1).astype(np.uint8)
