"""The C extensions: one module imports them, the process says which run, and calling them leaks nothing."""

from __future__ import annotations

import ast
import gc
import logging
import os
import sys
import tracemalloc
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway import native
from gateway.classifier import cues
from gateway.classifier.scoring import Classifier
from gateway.classifier.vocabulary import Alphabet, open_addressing
from gateway.features import estimate_tokens
from gateway.features import native as walker
from tests.fixtures.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI") == "true"


def _setup_extensions() -> set[str]:
    """The module names setup.py builds, read from its Extension(...) calls."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Extension"
            and isinstance(node.args[0], ast.Constant)}


def test_every_extension_setup_builds_has_a_named_python_twin() -> None:
    assert _setup_extensions() == set(native.TWINS) == set(native.loaded())
    for name in native.TWINS:  # each is built from a C file beside where its module would be
        assert (ROOT / (name.replace(".", "/") + ".c")).is_file(), name


def test_only_gateway_native_imports_an_extension() -> None:
    extensions = {name.rsplit(".", 1)[1] for name in native.TWINS}
    importers = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            if any(part in extensions for name in names for part in name.split(".")):
                importers.add(path.relative_to(ROOT).as_posix())
    assert importers == {"gateway/native/__init__.py"}


@pytest.mark.skipif(not IN_CI, reason="outside CI, a missing extension means its Python twin runs")
def test_every_extension_builds_in_ci() -> None:
    assert all(native.loaded().values()), native.describe()


async def test_the_running_gateway_logs_and_exports_which_extensions_run(
    make_stack: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.server.app"):
        stack: Stack = await make_stack()
    assert native.describe() in caplog.text
    async with aiohttp.ClientSession() as http, http.get(stack.gateway.make_url("/metrics")) as resp:
        text = await resp.text()
    for name, loaded in native.loaded().items():
        assert f'gateway_native_info{{extension="{name}",loaded="{str(loaded).lower()}"}} 1.0' in text


def test_a_missing_extension_is_named_with_its_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ask_cues", None)
    assert native.loaded()["gateway.native._ask_cues"] is False
    assert "gateway.native._ask_cues (not built: gateway.classifier.cues (re and str methods) runs)" in (
        native.describe())


# Reference leaks: each extension's functions called many times over the same inputs. A leaked reference shows in
# the inputs' refcounts; a leaked object or buffer in tracemalloc's count of what is still allocated, which must
# stop growing once warm (sys.gettotalrefcount needs a debug build of Python; this does not).
CALLS = 20_000


def _no_leak(call: Callable[[], object], inputs: tuple[object, ...]) -> None:
    for _ in range(200):  # warm: caches (interned strings, free lists) fill before counting
        call()
    gc.collect()
    counts = [sys.getrefcount(each) for each in inputs]
    tracemalloc.start()
    try:
        for _ in range(CALLS // 2):
            call()
        gc.collect()
        warm, _ = tracemalloc.get_traced_memory()
        for _ in range(CALLS // 2):
            call()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - warm
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(each) for each in inputs] == counts
    assert grown < 4096, f"{grown} bytes still allocated after {CALLS // 2} more calls"


def test_the_leak_check_sees_a_kept_reference_and_a_kept_object() -> None:
    kept: list[object] = []
    text = "held"
    with pytest.raises(AssertionError):
        _no_leak(lambda: kept.append(text), (text,))
    kept.clear()
    with pytest.raises(AssertionError, match="still allocated"):
        _no_leak(lambda: kept.append(object()), ())


def _needs(module: object) -> pytest.MarkDecorator:
    return pytest.mark.skipif(module is None and not IN_CI, reason="the extension did not build: its twin runs")


@_needs(native.ngram_score)
def test_the_ngram_table_leaks_nothing() -> None:
    block = Classifier.default().text_block
    table = block._table
    assert table is not None
    text = block.text.preprocess("Explain how a hash map handles collisions, with an example in Python. " * 8)
    _no_leak(lambda: table.logit(text), (text, table))
    weights = dict(list(block.weights.items())[:500])
    alphabet = Alphabet(weights)
    keys, values = open_addressing([alphabet.key(g) for g in weights], list(weights.values()))
    points = array("I", map(ord, alphabet.chars))
    ids = alphabet.ascii_ids()
    assert native.ngram_score is not None
    build = native.ngram_score.Table
    _no_leak(lambda: build(ids, points, keys, values, 2, 4), (ids, points, keys, values))


@_needs(native.ask_cues)
def test_the_ask_reader_leaks_nothing() -> None:
    reader = cues._ascii_reader
    assert reader is not None
    tail = "Find the degree of Q(sqrt(2)) over Q.\nA. 0\nB. 4\nC. 2\nD. 6\nWrite code. Why not? Answer:"
    opening = tail[: cues.OPENING_CHARS]
    _no_leak(lambda: reader.read(tail, opening), (reader, tail, opening))
    not_ascii = "não"

    def refused() -> None:
        with pytest.raises(ValueError):
            reader.read(not_ascii, opening)

    _no_leak(refused, (reader, not_ascii, opening))


@_needs(native.features_walk)
def test_the_features_walk_leaks_nothing() -> None:
    assert walker is not None
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "def f(x):\n    return x ** 2\nWhat is f(3)? $x^2$"},
                {"role": "assistant", "content": "9"},
                {"role": "tool", "content": "exit 0"},
                {"role": "user", "content": "And f(4)?"}]
    odd = [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]  # left to the Python walk: None
    _no_leak(lambda: walker.walk(messages, 10_000, len, estimate_tokens), (messages, *messages))
    _no_leak(lambda: walker.walk(messages, 10_000, None, estimate_tokens), (messages,))
    _no_leak(lambda: walker.walk(odd, 10_000, len, estimate_tokens), (odd, odd[0]))
    window = "\nWhat is f(3)? $x^2$\n∫ self.x"
    _no_leak(lambda: walker.markers(window), (window,))
