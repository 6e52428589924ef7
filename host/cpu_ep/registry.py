"""The table of CPU kernels, filled explicitly by the `register` decorator."""

from __future__ import annotations

from collections.abc import Callable

from host.cpu_ep.base import OpKernel

# (domain, op_type) -> [(since, until, kernel class)]; `until` is the last opset served
# (inclusive), None meaning "up to the newest opset".
CPU_KERNELS: dict[tuple[str, str], list[tuple[int, int | None, type[OpKernel]]]] = {}


def _canonical_domain(domain: str) -> str:
    # "ai.onnx" and "" name the same default domain.
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str, domain: str = "", since: int = 1,
             until: int | None = None) -> Callable[[type[OpKernel]], type[OpKernel]]:
    """Class decorator: serve `op_type` of `domain` for opsets since..until (inclusive)."""

    def deco(cls: type[OpKernel]) -> type[OpKernel]:
        if not (isinstance(cls, type) and issubclass(cls, OpKernel)):
            raise TypeError(f"{cls!r} is not an OpKernel subclass")
        entries = CPU_KERNELS.setdefault((_canonical_domain(domain), op_type), [])
        hi = until if until is not None else 1 << 30
        for lo2, until2, other in entries:
            hi2 = until2 if until2 is not None else 1 << 30
            if since <= hi2 and lo2 <= hi:
                raise ValueError(f"{cls.__name__} and {other.__name__} both serve {op_type} at "
                                 f"opsets {max(since, lo2)}..{min(hi, hi2)}")
        entries.append((since, until, cls))
        return cls

    return deco


def lookup(domain: str, op_type: str, opset: int) -> type[OpKernel] | None:
    """The kernel class serving `op_type` at `opset`, or None."""
    for since, until, cls in CPU_KERNELS.get((_canonical_domain(domain), op_type), ()):
        if since <= opset and (until is None or opset <= until):
            return cls
    return None


def supported_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) with at least one kernel, sorted."""
    return sorted(CPU_KERNELS)
