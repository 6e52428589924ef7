"""Property 3: the documented fallbacks, and only they, are taken, as many times as documented.

FALLBACKS below is the table: for each fallback, where it is recorded (the session's
`fallbacks` Counter or the plugin Record's `fallbacks`), under which key, and how many times a
scenario must record it, as a function of the negotiated version n = min(host, plugin), the Ep
slots the plugin left NULL, the options and the model of scenario.py (kernel calls, captures,
replays). After each generated scenario both Counters must equal the table's prediction
exactly. FALLBACK_TABLE_MD is the same table for the README.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings

from tests.property import harness as h
from tests.property import scenario
from tests.property.scenario import Events, Scenario

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fallback:
    where: str                                  # "session" or "plugin"
    key: Callable[[Scenario], str] | str        # the Counter key (a function for host_api_vN)
    count: Callable[[Scenario, Events], int]    # how many times the scenario records it

    def key_for(self, sc: Scenario) -> str:
        return self.key(sc) if callable(self.key) else self.key


def _on_plan(sc: Scenario) -> bool:
    """ExampleEP runs at least one node (an EP without nodes is not in the session's plan)."""
    return sc.plugin_nodes > 0


def _concurrent(sc: Scenario) -> bool:
    return not _on_plan(sc) or h.concurrent(sc.negotiated, sc.null_slots, sc.opts)


def _sync_replays(ev: Events) -> int:
    return sum(ev.replays)


def _stream_sync(sc: Scenario) -> bool:
    return sc.ep_has("ReplayGraphWithSync")  # v5 and not NULL


FALLBACKS: dict[str, Fallback] = {
    # n < 3: the host never asks about graphs; counted once per session and plugin EP asked for.
    "no capture": Fallback("session", "no_graph_capture", lambda sc, ev: int(sc.negotiated < 3)),
    # n = 1, IsConcurrentRunSupported NULL, or the EP says no (ExampleEP while capturing graphs).
    "serialised runs": Fallback("session", "serialised_runs", lambda sc, ev: int(not _concurrent(sc))),
    "concurrent runs": Fallback("session", "concurrent_runs", lambda sc, ev: int(_concurrent(sc))),
    "graph captured": Fallback("session", "graph_captured", lambda sc, ev: ev.captured),
    # Capture on but OnRunStart/OnRunEnd NULL: the EP never captures; the host gives up (and warns).
    "capture not reached": Fallback("session", "capture_not_reached", lambda sc, ev: ev.gave_up),
    # Replay with sync on n = 3/4 (or ReplayGraphWithSync NULL): ReplayGraph, then a device-wide Sync.
    "device-wide sync": Fallback("session", "replay_device_sync",
                                 lambda sc, ev: 0 if _stream_sync(sc) else _sync_replays(ev)),
    "device-wide sync (plugin)": Fallback("plugin", "ep_device_sync",
                                          lambda sc, ev: 0 if _stream_sync(sc) or not sc.ep_has("Sync")
                                          else _sync_replays(ev)),
    # Replay with sync on n = 5: the EP syncs its own graph stream.
    "stream sync": Fallback("session", "replay_stream_sync",
                            lambda sc, ev: _sync_replays(ev) if _stream_sync(sc) else 0),
    "stream sync (plugin)": Fallback("plugin", "ep_stream_sync",
                                     lambda sc, ev: _sync_replays(ev) if _stream_sync(sc) else 0),
    # disable_synchronize_execution_providers=1: no sync at all after a replay.
    "async replay": Fallback("session", "replay_async", lambda sc, ev: len(ev.replays) - _sync_replays(ev)),
    # n < 4: no KernelContext_GetSyncStream, scratch memory is not tagged with a stream (per Compute).
    "untagged scratch": Fallback("plugin", "untagged_scratch",
                                 lambda sc, ev: ev.computes if sc.negotiated < 4 else 0),
    # Plugin newer than the host: it asks GetApi(host version) (once per registration).
    "host API fallback": Fallback("plugin", lambda sc: f"host_api_v{sc.host}",
                                  lambda sc, ev: int(sc.host < sc.plugin)),
}

FALLBACK_TABLE_MD = """\
| Fallback | When (n = min(host API version, plugin ABI version)) | Host: `session.fallbacks` | Plugin: `Record.fallbacks` |
|---|---|---|---|
| No graph capture | n < 3 (the v3 graph slots do not exist) | `no_graph_capture` (once per session and plugin EP) | — |
| Graph capture off, silently | n >= 3 but `Ep.IsGraphCaptureEnabled`, `Ep.IsGraphCaptured` or `Ep.ReplayGraph` NULL | nothing recorded | — |
| Serialised runs | a plugin EP that runs nodes of the session has n = 1, or `Ep.IsConcurrentRunSupported` NULL, or answers no (ExampleEP while `enable_graph=1`) | `serialised_runs` (once per session; `concurrent_runs` otherwise) | — |
| Capture never reached | capture on but `Ep.OnRunStart` or `Ep.OnRunEnd` NULL: runs eagerly after 16 tries, with a `RuntimeWarning` | `capture_not_reached` (per bound run of an uncaptured id) | — |
| Device-wide sync after replay | synchronised replay on n = 3 or 4, or n = 5 with `Ep.ReplayGraphWithSync` NULL: `ReplayGraph` then `Ep.Sync` | `replay_device_sync` (per replay) | `ep_device_sync` (per `Ep.Sync` call; none when `Ep.Sync` is NULL) |
| Stream sync after replay | synchronised replay on n = 5: `ReplayGraphWithSync(id, 1)` syncs the EP's graph stream | `replay_stream_sync` (per replay) | `ep_stream_sync` (per replay) |
| Asynchronous replay | `disable_synchronize_execution_providers=1`, n >= 3 | `replay_async` (per replay) | — |
| Untagged scratch | n < 4 (no `EpApi.KernelContext_GetSyncStream`): host < 4 or plugin < 4 | — | `untagged_scratch` (per kernel `Compute`) |
| Older host API | host < plugin: the plugin asks `GetApi(host)` and installs only the slots of that version | — | `host_api_vN`, N = host version (once per registration) |
"""


def expected(sc: Scenario, ev: Events) -> tuple[Counter, Counter]:
    by_where: dict[str, Counter] = {"session": Counter(), "plugin": Counter()}
    for fb in FALLBACKS.values():
        if fb.where == "session" and not ev.created:
            continue  # a refused session has no Counter to read
        by_where[fb.where][fb.key_for(sc)] += fb.count(sc, ev)
    return +by_where["session"], +by_where["plugin"]


@given(sc=scenario.scenarios())
@settings(deadline=None)
def test_recorded_fallbacks_match_the_table(sc):
    with h.example_env(sc.host, [sc.plugin]) as env:
        out = scenario.play(sc, env)
    ev = scenario.model(sc)
    assert out.created is ev.created
    want_session, want_plugin = expected(sc, ev)
    assert +out.session_fallbacks == want_session
    assert +out.record_fallbacks == want_plugin


@pytest.mark.parametrize("host", range(1, 6))
@pytest.mark.parametrize("plugin", range(1, 6))
def test_registration_alone_records_only_the_host_api_fallback(host, plugin):
    with h.example_env(host, [plugin]):
        pass
    assert +h.record(plugin).fallbacks == (Counter({f"host_api_v{host}": 1}) if host < plugin else Counter())


def test_table_and_markdown_agree():
    keys = {fb.key for fb in FALLBACKS.values() if isinstance(fb.key, str)} - {"concurrent_runs", "graph_captured"}
    missing = sorted(k for k in keys if f"`{k}`" not in FALLBACK_TABLE_MD)
    assert missing == []
    assert "`host_api_vN`" in FALLBACK_TABLE_MD


def _readme_section(text: str, title: str) -> str | None:
    """The body of the README section headed `title` (## or deeper), up to the next heading."""
    m = re.search(rf"^(#{{2,}}) {re.escape(title)}[ \t]*$", text, re.MULTILINE)
    if m is None:
        return None
    nxt = re.compile(rf"^#{{1,{len(m.group(1))}}} ", re.MULTILINE).search(text, m.end())
    return text[m.end():nxt.start() if nxt else len(text)]


def test_readme_has_the_fallback_table():
    readme = ROOT / "README.md"
    section = _readme_section(readme.read_text(encoding="utf-8"), "Fallback table") if readme.is_file() else None
    # A section that holds no Markdown table yet (a placeholder) is not written either.
    if section is None or not re.search(r"^\|[-| :]+\|\s*$", section, re.MULTILINE):
        pytest.skip("README fallback section not written yet")
    assert FALLBACK_TABLE_MD in section
