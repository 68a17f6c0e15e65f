"""vLLM's tool-call formats as a test reads them: each tool parser that has a structural tag,
loaded from vLLM's own registry, and random walks of a grammask mask that end in text.

Most of vLLM 0.34's tool parsers are built by ``vllm.parser.engine.registered_adapters``,
which also imports its Mistral parser (``mistral_common``, ``ijson``). Where those are not
installed, ``tool_parser`` still loads the other parsers: a stand-in for that one module
builds each adapter the way it does (``make_adapters`` of the parser class it names, read
from its own source), without the Mistral one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import random
import sys
import types
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from grammask import Vocabulary
from grammask.backends import Matcher

from .helpers import mask_of

_ADAPTERS = "vllm.parser.engine.registered_adapters"


def stand_in_admission(monkeypatch: Any) -> SimpleNamespace:
    """The admission hook with a stand-in server config (``holder.config``): vLLM's real
    ``StructuredOutputsConfig``, no speculative decoding, the V1 runner."""
    from vllm.config import StructuredOutputsConfig

    from grammask.integrations.vllm import admission

    holder = SimpleNamespace(config=SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(backend="auto"),
        speculative_config=None, use_v2_model_runner=False, model_config=None,
        additional_config=None))
    monkeypatch.setattr(admission, "admission_config", lambda: holder.config)
    admission._settings_of.cache_clear()
    admission._DROPIN.clear()
    monkeypatch.setattr(admission, "_DROPIN", {})
    return holder


@cache
def tool_parsers() -> dict[str, tuple[str, type]]:
    """Parser name -> (structural-tag model key, parser class), for every tool parser of
    vLLM's registry whose class names a key its structural-tag registry builds."""
    from vllm.tool_parsers import ToolParserManager
    from vllm.tool_parsers import structural_tag_registry as registry

    # vLLM's own builders (``minimax`` is one) are missing from SUPPORTED_...
    keys = {*registry.SUPPORTED_STRUCTURAL_TAG_MODELS,
            *registry._VLLM_STRUCTURAL_TAG_REGISTRY}
    _adapters_importable()
    out = {}
    for name in sorted(ToolParserManager.lazy_parsers):
        try:
            cls = ToolParserManager.get_tool_parser(name)
        except ModuleNotFoundError as exc:
            if exc.name in ("mistral_common", "ijson"):
                continue  # the Mistral parser itself
            raise
        model = getattr(cls, "structural_tag_model", None)
        if model in keys:
            out[name] = (model, cls)
    return out


def _adapters_importable() -> None:
    """Import ``registered_adapters``, or put the stand-in (module doc) in its place."""
    try:
        importlib.import_module(_ADAPTERS)
    except ModuleNotFoundError as exc:
        if exc.name not in ("mistral_common", "ijson"):
            raise
        sys.modules[_ADAPTERS] = _stand_in()


def _stand_in() -> types.ModuleType:
    spec = importlib.util.find_spec(_ADAPTERS)
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    sources: dict[str, str] = {}
    made: dict[str, tuple[str, int]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm.parser."):
            sources.update({a.asname or a.name: str(node.module) for a in node.names})
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "make_adapters"
                and isinstance(node.targets[0], ast.Tuple)):
            parser = node.value.args[0]
            assert isinstance(parser, ast.Name)
            for i, target in enumerate(node.targets[0].elts):
                assert isinstance(target, ast.Name)
                made[target.id] = (parser.id, i)
    module = types.ModuleType(_ADAPTERS)

    @cache
    def adapters(parser: str) -> tuple[type, type]:
        from vllm.parser.engine.adapters import make_adapters

        found: tuple[type, type] = make_adapters(
            getattr(importlib.import_module(sources[parser]), parser))
        return found

    def attribute(name: str) -> Any:
        if name not in made:
            raise AttributeError(name)
        parser, i = made[name]
        return adapters(parser)[i]

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


# ------------------------------------------------------------------------------ walks
#: a token choice: (allowed ids, the vocabulary, the rng) -> the next token
Policy = Callable[[np.ndarray, Vocabulary, random.Random], int]


def walk(matcher: Matcher, vocab: Vocabulary, policy: Policy, rng: random.Random, *,
         steps: int) -> tuple[list[int], bool]:
    """Tokens the mask allows, one at a time, chosen by ``policy``, until only a stop
    token is allowed (or chosen); (tokens, whether it ended within ``steps``)."""
    stops = set(vocab.stop_ids)
    out: list[int] = []
    for _ in range(steps):
        allowed = _allowed(matcher, vocab)
        if len(allowed) <= len(stops) and set(allowed.tolist()) <= stops:
            return out, True
        token = policy(allowed, vocab, rng)
        if token in stops:
            return out, True
        assert matcher.accept(token), (token, vocab.decode(out))
        out.append(token)
    return out, False


def _allowed(matcher: Matcher, vocab: Vocabulary) -> np.ndarray:
    """The ids the mask allows, ascending."""
    words = mask_of(matcher, vocab).numpy().view(np.uint8)
    bits = np.unpackbits(words, bitorder="little")[:vocab.vocab_size]
    return np.flatnonzero(bits)


def _pick(ids: np.ndarray, rng: random.Random) -> int:
    return int(ids[rng.randrange(len(ids))])


def uniform(allowed: np.ndarray, vocab: Vocabulary, rng: random.Random) -> int:
    """Any allowed token, stop tokens included."""
    return _pick(allowed, rng)


def longest(allowed: np.ndarray, vocab: Vocabulary, rng: random.Random) -> int:
    """Never a stop token while another is allowed: the walk ends only where the mask
    ends it."""
    going = allowed[~np.isin(allowed, vocab.stop_ids)]
    return _pick(going if len(going) else allowed, rng)


def spacious(allowed: np.ndarray, vocab: Vocabulary, rng: random.Random) -> int:
    """Whitespace wherever allowed (the longest run first), else as ``longest``."""
    lengths = _blank(vocab)[allowed]
    if not lengths.any():
        return longest(allowed, vocab, rng)
    return _pick(allowed[lengths == lengths.max()], rng)


@cache
def _blank(vocab: Vocabulary) -> np.ndarray:
    """Per token id: its length where it is whitespace only (not a stop token), else 0."""
    out = np.zeros(vocab.vocab_size, dtype=np.int64)
    for token in range(vocab.vocab_size):
        text = vocab.decode([token])
        if text and not text.strip() and token not in vocab.stop_ids:
            out[token] = len(text)
    return out


POLICIES: dict[str, Policy] = {"uniform": uniform, "longest": longest, "spacious": spacious}


def capped(policy: Policy, token: int, most: int) -> Policy:
    """``policy`` until it has chosen ``token`` ``most`` times, then a stop token wherever
    one is allowed: for a grammar that repeats a call without bound (Mistral's
    ``(call)+``), whose longest walks would otherwise never end."""
    chosen = 0

    def pick(allowed: np.ndarray, vocab: Vocabulary, rng: random.Random) -> int:
        nonlocal chosen
        stops = allowed[np.isin(allowed, vocab.stop_ids)]
        if chosen >= most and len(stops):
            return int(stops[0])
        out = policy(allowed, vocab, rng)
        chosen += out == token
        return out

    return pick


def texts(matcher_of: Callable[[], Matcher], vocab: Vocabulary, *, seed: int, walks: int,
          steps: int, policies: Callable[[], dict[str, Policy]] | None = None,
          decode: Callable[[list[int]], str] | None = None
          ) -> Iterator[tuple[str, str, bool]]:
    """(policy, text, ended) for ``walks`` walks of each policy (``POLICIES``, or a fresh
    ``policies()`` for each walk); the text is ``decode`` of the tokens (default: the
    vocabulary's bytes as UTF-8)."""
    rng = random.Random(seed)
    for name in (policies() if policies else POLICIES):
        for _ in range(walks):
            policy = (policies() if policies else POLICIES)[name]
            tokens, ended = walk(matcher_of(), vocab, policy, rng, steps=steps)
            text = (decode(tokens) if decode is not None
                    else vocab.decode(tokens).decode("utf-8", "replace"))
            yield name, text, ended
