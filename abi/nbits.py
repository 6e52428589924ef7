"""com.microsoft MatMulNBits' packing of low-bit codes, shared by the CPU kernel
(host/cpu_ep/ops_quant_nbits.py), the optimizer rule that writes it (host/optimizer/rules/qdq_nbits.py)
and its fallback expansion: codes of `bits` bits (2, 4 or 8), 8 // bits to a byte, the first code in
the low bits; B is (N, k_blocks, block_size * bits / 8), scales (N, k_blocks), zero points packed the
same way per column (uint8) or one float per block, by default 2**(bits - 1)."""

from __future__ import annotations

import numpy as np

F32 = np.dtype(np.float32)


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


class NBitsLayout:
    """The attributes of a MatMulNBits node and the shapes they imply."""

    def __init__(self, k: int, n: int, bits: int, block_size: int):
        self.k, self.n, self.bits, self.block_size = k, n, bits, block_size
        self.k_blocks = -(-k // block_size)
        self.blob = block_size * bits // 8
        self.zp_bytes = -(-self.k_blocks * bits // 8)

    def check(self, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> None:
        want = {"B": (b, self.n * self.k_blocks * self.blob), "scales": (scales, self.n * self.k_blocks)}
        if zero_points is not None:
            per_col = self.k_blocks if zero_points.dtype.kind == "f" else self.zp_bytes
            want["zero_points"] = (zero_points, self.n * per_col)
        for name, (arr, size) in want.items():
            if arr.size != size:
                raise ValueError(f"input {name} has {arr.size} elements (shape {list(arr.shape)}); K={self.k}, "
                                 f"N={self.n}, bits={self.bits}, block_size={self.block_size} need {size}")

    def row_blocks(self, g_idx: np.ndarray | None) -> np.ndarray:
        """The block of each of the K rows: row // block_size, or g_idx where the model gives it."""
        if g_idx is None:
            return np.arange(self.k) // self.block_size
        idx = np.asarray(g_idx).reshape(-1).astype(np.intp)
        if idx.size != self.k or (idx.size and (idx.min() < 0 or idx.max() >= self.k_blocks)):
            raise ValueError(f"g_idx must hold K={self.k} block indices in [0, {self.k_blocks}); got "
                             f"{idx.size} values")
        return idx

    def dequantize(self, b, scales, zero_points, g_idx, columns: slice = slice(None)) -> np.ndarray:
        """The float32 weight (K, columns) that B, scales and zero points encode."""
        self.check(b, scales, zero_points)
        rows = self.row_blocks(g_idx)
        b3 = b.reshape(self.n, self.k_blocks * self.blob)[columns]
        codes = unpack_codes(b3, self.bits, self.k_blocks * self.block_size)[:, :self.k]
        scale = scales.reshape(self.n, self.k_blocks)[columns].astype(F32)
        if zero_points is None:
            zp = np.float32(1 << (self.bits - 1))
        elif zero_points.dtype.kind == "f":
            zp = zero_points.reshape(self.n, self.k_blocks)[columns].astype(F32)[:, rows]
        else:
            packed = zero_points.reshape(self.n, self.zp_bytes)[columns]
            zp = unpack_codes(packed, self.bits, self.k_blocks).astype(F32)[:, rows]
        w_t = (codes.astype(F32) - zp) * scale[:, rows]
        return np.ascontiguousarray(w_t.T)
