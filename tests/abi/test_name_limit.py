"""Names a plugin returns (EpFactory.GetName and friends) are read whole up to the limit, or refused."""

from __future__ import annotations

import pytest

from host.errors import EpError, PluginLoadError
from host.plugins import loader
from host.plugins.hostapi import ffi

LIMIT = loader.MAX_NAME_BYTES


def c_string(text: bytes):
    return ffi.new("char[]", text)


@pytest.mark.parametrize("size", [1, LIMIT - 1, LIMIT])
def test_a_name_up_to_the_limit_is_read_whole(size):
    name = b"n" * size
    assert loader.text(c_string(name), "EpFactory.GetName") == name.decode()


@pytest.mark.parametrize("size, error", [(LIMIT + 1, PluginLoadError), (3 * LIMIT, EpError)])
def test_a_longer_name_is_refused_naming_the_limit(size, error):
    # Before: the first 4096 bytes came back as the name, so the EP could not be chosen by the name it reports.
    with pytest.raises(error, match=rf"^plugin 'p': EpFactory.GetName is longer than {LIMIT} bytes "
                                    rf"\(b'nnnn.*'\.\.\.\); names are limited to {LIMIT} bytes of UTF-8 "):
        loader.text(c_string(b"n" * size), "plugin 'p': EpFactory.GetName", error)
