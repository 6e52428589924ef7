"""Property 3: the documented fallbacks, and only they, are taken, as many times as documented.

The table is tests/property/fallback_table.py (ROWS): for each fallback, where it is recorded
(the session's `fallbacks` Counter or the plugin Record's `fallbacks`), under which key, and how
many times a scenario must record it, as a function of the negotiated version n = min(host,
plugin), the Ep slots the plugin left NULL, the options and the model of scenario.py (kernel
calls, captures, replays). After each scenario both Counters must equal the table's prediction
exactly, the plugin's kernel Compute calls must equal the model's, and every output equals the
references. The README's table is rendered from the same ROWS.

Every row has its own test, drawing only scenarios where that row's situation arises, so each
row is exercised in every CI run; so is capture-then-replay for every (negotiated version,
sync mode) pair.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property import fallback_table as ft
from tests.property import harness as h
from tests.property import scenario
from tests.property import strategies as s
from tests.property.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]
# Counted by the table instead (compile_failed, capture_not_reached).
pytestmark = [pytest.mark.filterwarnings("ignore:ExampleEP.*could not be compiled:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:ExampleEP did not capture graph:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:compiled context of .* not used:RuntimeWarning")]


def check_scenario(sc: Scenario, with_refs: bool = True) -> scenario.Events:
    """Play `sc`; the recorded fallbacks and Compute calls are what the table and the model say."""
    refs = h.References(sc.case) if with_refs else None
    with h.example_env(sc.host, [sc.plugin]) as env:
        out = scenario.play(sc, env, refs)
    ev = scenario.model(sc)
    assert out.created is ev.created
    want_session, want_plugin = ft.expected(sc, ev)
    assert +out.session_fallbacks == want_session
    assert +out.record_fallbacks == want_plugin
    assert out.slot_calls["EpKernel.Compute"] == ev.computes
    return ev


@given(sc=scenario.scenarios())
@settings(deadline=None, max_examples=s.budget(12))  # the row tests below reach every row; this mixes them
def test_recorded_fallbacks_match_the_table(sc):
    check_scenario(sc, with_refs=False)


def _reaching(row: ft.Row):
    return row.scenarios().filter(lambda sc: row.holds(sc, scenario.model(sc)))


@pytest.mark.parametrize("row", ft.ROWS, ids=[r.title for r in ft.ROWS])
@settings(deadline=None, max_examples=s.budget(2))
@given(data=st.data())
def test_every_row_is_exercised_and_holds(row, data):
    sc = data.draw(_reaching(row), label="scenario")
    ev = check_scenario(sc)
    assert row.holds(sc, ev)
    # A row that holds records something (or, for a silent one, nothing beyond the other rows).
    assert not row.counts or any(c.count(sc, ev) > 0 for c in row.counts)


REPLAY_PAIRS = [(n, sync) for n in ft.CAPTURE_VERSIONS for sync in (True, False)]


@pytest.mark.parametrize("negotiated,sync", REPLAY_PAIRS, ids=[f"v{n}-{'sync' if y else 'async'}"
                                                              for n, y in REPLAY_PAIRS])
@settings(deadline=None, max_examples=s.budget(2))
@given(data=st.data())
def test_capture_then_replay_for_every_version_and_sync_mode(negotiated, sync, data):
    """Every CI run captures and replays at every negotiated version with each sync mode."""
    sc = data.draw(ft.capture_scenarios(negotiated, sync), label="scenario")
    ev = check_scenario(sc)
    assert ev.captured >= 1
    assert sum(r == sync for r in ev.replays) >= 1


@pytest.mark.parametrize("host", s.VERSIONS)
@pytest.mark.parametrize("plugin", s.VERSIONS)
def test_registration_alone_records_only_the_host_api_fallback(host, plugin):
    with h.example_env(host, [plugin]):
        pass
    assert +h.record(plugin).fallbacks == (Counter({f"host_api_v{host}": 1}) if host < plugin else Counter())


def test_every_counter_key_is_in_the_markdown():
    md = ft.markdown()
    keys = {c.key for r in ft.ROWS for c in r.counts if isinstance(c.key, str)}
    assert sorted(k for k in keys if f"`{k}`" not in md) == []
    assert "`host_api_vN`" in md
    assert [line.count(" | ") for line in md.splitlines()[2:]] == [3] * (len(ft.ROWS) + len(ft.HOST_ROWS))


@pytest.mark.parametrize("row", ft.HOST_ROWS, ids=[r.title for r in ft.HOST_ROWS])
def test_every_host_row_names_its_property(row):
    """A host row's property exists and is a hypothesis test (it runs in every CI run with this suite)."""
    file, _, name = row.test.partition("::")
    module = importlib.import_module(f"tests.property.{file.removesuffix('.py')}")
    test = getattr(module, name, None)
    assert test is not None and getattr(test, "is_hypothesis_test", False), row.test


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
    assert section is not None, "README.md has no 'Fallback table' section"
    assert ft.markdown() in section, "README's fallback table differs: python -m tests.property.fallback_table"


@settings(deadline=None, max_examples=s.budget(2))
@given(data=st.data())
def test_contexts_saved_beside_the_model_are_reloaded(data):
    """ep.context_embed_mode=0: each context is a file beside the saved model; the row 'Compiled
    partitions reloaded' holds for those as for embedded ones."""
    row = next(r for r in ft.ROWS if r.title == "Compiled partitions reloaded")
    sc = data.draw(ft._contexts("external", ft.V7_PAIRS).filter(lambda sc: row.holds(sc, scenario.model(sc))))
    ev = check_scenario(sc)
    assert row.holds(sc, ev)
