"""A method wrapped to record its calls, for tests that count what a run or a creation does."""

from __future__ import annotations


def record_calls(monkeypatch, owner, name: str) -> list:
    """`owner.name` (a one-argument method) wrapped for the test: each call appends its argument to the
    returned list, then runs the real method."""
    calls = []
    real = getattr(owner, name)

    def recorded(self, arg):
        calls.append(arg)
        return real(self, arg)

    monkeypatch.setattr(owner, name, recorded)
    return calls
