"""Tests of the ABI contract: header rules, golden layouts, version matrix, load errors, C interop."""
