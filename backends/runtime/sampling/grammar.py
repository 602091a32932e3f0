"""Structured outputs (``backends.ipc.protocol.StructuredOutput``: a JSON schema, any JSON object, a regular
expression, an EBNF grammar) held by xgrammar, the library vLLM and SGLang use for them.

A sequence with one has a ``GrammarMatcher``: before each of its tokens is sampled, the matcher fills a bitmask of
the tokens that can continue a match (on the host; 32 tokens a 32-bit word), which is applied to the step's logits
on the device (-inf where a bit is 0) after the bias and the penalties; the sampled token is then accepted by the
matcher. Once the match is whole, only the eos tokens (the tokenizer's, given as xgrammar's stop tokens) are
allowed, and the matcher is terminated when one is accepted. encode_prefill masks a prompt's first token with a
fresh matcher and feeds it the sampled token; decode keeps a matcher per sequence, which has accepted that first
token at admission. Compiled grammars are cached per process (xgrammar's ``GrammarCompiler`` cache, keyed by the
grammar's text, at most ``CACHE_BYTES``).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch
import xgrammar as xgr

from backends.ipc.protocol import NO_MATCH, StructuredOutput

_LOCATION = re.compile(r"^\[[^\]]*\] [^:\s]+:\d+: (Check failed: .*? is false: )?")  # "[12:00:00] file.cc:42: "
ANY_OBJECT = '{"type": "object"}'  # json_object: "a JSON object" (OpenAI's), compiled as vLLM compiles it
CACHE_BYTES = 512 << 20  # each process's compiled grammars (vLLM's default xgrammar cache: about 1000 schemas)
_BYTES = 256  # the check's vocabulary: one token per byte, so any tokenizer's outputs are its strings
# Triton builds a kernel per specialization of its integer arguments: the rows (a step's sequences) on being 1 and on
# being a multiple of 16; one built on first use stalls the step that needs it (the likely part of a 32-prompt burst's
# 295-ms first step under text_c32_structured, about 50 without grammars: bench/results/peer/README.md; not measured)
WARM_ROWS = (1, 2, 16)


def compiled(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """``spec`` compiled from its text (``compiler``'s cache is keyed by the text: a repeat compiles nothing).
    Raises ValueError naming what xgrammar found wrong (a schema keyword it does not know, a regex that does not
    parse, an undefined rule), without its C++ source location."""
    try:
        if spec.kind in ("json", "json_object"):
            text = spec.text if spec.kind == "json" else ANY_OBJECT
            return compiler.compile_json_schema(text, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        return compiler.compile_grammar(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own errors) from C++
        raise ValueError(_LOCATION.sub("", str(exc).strip()) or "xgrammar could not compile it and gave no reason (a "
                         "number too long for it is one such case)") from None


@functools.cache
def _byte_compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo([bytes([b]) for b in range(_BYTES)], vocab_type=xgr.VocabType.RAW)
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=64 << 20)


def check(spec: StructuredOutput) -> None:
    """What the orchestrator asks of a request's ``spec`` before the stages see it: that xgrammar compiles it
    (over a vocabulary of the 256 bytes: cheap, and no tokenizer's), and that some output matches it (a grammar
    whose first byte can be none and that is not complete empty, ``root ::= root``, would leave its sequences no
    token). Raises ValueError as :func:`compiled` does, or "no output can match it"."""
    matcher = xgr.GrammarMatcher(compiled(_byte_compiler(), spec))
    bitmask = xgr.allocate_token_bitmask(1, _BYTES)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()) and not matcher.is_completed():
        raise ValueError("no output can match it")


class Grammars:
    """One stage process's grammars: xgrammar's view of the tokenizer (``vocab_size`` the logits' width, the rows
    past the tokenizer's ids never allowed; ``eos_ids`` the tokens that end a whole match) and its compiler. On a
    CUDA ``device`` the mask's kernel (xgrammar's, a Triton kernel compiled on first use) is built here, before a
    request needs it, in each of its specializations (:data:`WARM_ROWS`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], device: torch.device | None = None):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        if device is not None and device.type == "cuda":
            for rows in WARM_ROWS:  # float32, as the stages' logits
                self._apply(torch.zeros(rows, vocab_size, device=device), xgr.allocate_token_bitmask(rows, vocab_size))

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        """A new matcher at the start of ``spec``'s grammar (compiled once per grammar text in this process, which
        takes milliseconds to a second with a 150k-token vocabulary; later ones find it in the cache). Raises
        ValueError as :func:`compiled` does."""
        return xgr.GrammarMatcher(compiled(self._compiler, spec))

    def mask(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """``logits`` [rows, vocab_size] (any float dtype, any device) with each row whose matcher is given masked
        in place to the tokens that continue its match (-inf elsewhere); rows without one are left as they are (no
        row with one: nothing is done). The bitmask is filled on the host and copied over without waiting for the
        device."""
        if all(matcher is None for matcher in matchers):
            return logits
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # int32, all bits 1: nothing masked
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, row)
        return self._apply(logits, bitmask)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits


def accepted(matcher: xgr.GrammarMatcher, token: int) -> str:
    """Feed ``token`` to ``matcher``: "" while the match goes on, "stop" once it has ended (an eos token after a
    whole match), ``NO_MATCH`` for a token the grammar does not allow: sampled from a mask that allowed none (the
    grammar dead-ends, ``root ::= "a" b; b ::= b "c"``), the request is the client's to fail."""
    if not matcher.accept_token(token):
        return NO_MATCH
    return "stop" if matcher.is_terminated() else ""
