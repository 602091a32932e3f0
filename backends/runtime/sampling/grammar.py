"""Structured outputs (``backends.ipc.protocol.StructuredOutput``: a JSON schema, any JSON object, a regular
expression, an EBNF grammar) held by xgrammar, the library vLLM and SGLang use for them.

A sequence with one has a ``GrammarMatcher``: before each of its tokens is sampled, the matcher fills a bitmask of
the tokens that can continue a match (on the host; 32 tokens a 32-bit word), which is applied to the step's logits
on the device (-inf where a bit is 0) after the bias and the penalties; the sampled token is then accepted by the
matcher. Once the match is whole, only the eos tokens (the tokenizer's, given as xgrammar's stop tokens) are
allowed, and the matcher is terminated when one is accepted. encode_prefill masks a prompt's first token with a
fresh matcher; decode keeps a matcher per sequence, which has accepted that first token at admission.
Compiled grammars are cached per process (xgrammar's ``GrammarCompiler`` cache, keyed by the grammar).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import xgrammar as xgr

from backends.ipc.protocol import StructuredOutput

_LOCATION = re.compile(r"^\[[^\]]*\] [^:\s]+:\d+: (Check failed: .*? is false: )?")  # "[12:00:00] file.cc:42: "


def build(spec: StructuredOutput) -> xgr.Grammar:
    """``spec``'s grammar (no tokenizer needed: the orchestrator checks requests with it). Raises ValueError
    naming what xgrammar found wrong (an unsupported schema keyword, a regex that does not parse, an undefined
    rule), without its C++ source location."""
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        return xgr.Grammar.from_ebnf(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own errors) from C++
        raise ValueError(_LOCATION.sub("", str(exc).strip())) from None


class Grammars:
    """One stage process's grammars: xgrammar's view of the tokenizer (``vocab_size`` the logits' width, the rows
    past the tokenizer's ids never allowed; ``eos_ids`` the tokens that end a whole match) and its compiler. On a
    CUDA ``device`` the mask's kernel (xgrammar's, a Triton kernel compiled on first use) is built here, before a
    request needs it."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], device: torch.device | None = None):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        if device is not None and device.type == "cuda":
            self.mask(torch.zeros(1, vocab_size, device=device), [None])

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        """A new matcher at the start of ``spec``'s grammar (compiled once per grammar in this process: the first
        request with a new JSON schema waits for it, milliseconds to a second with a 150k-token vocabulary). Raises
        ValueError as :func:`build` does."""
        return xgr.GrammarMatcher(self._compiler.compile_grammar(build(spec)))

    def mask(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """``logits`` [rows, vocab_size] (any float dtype, any device) with each row whose matcher is given masked
        in place to the tokens that continue its match (-inf elsewhere); rows without one are left as they are.
        The bitmask is filled on the host and copied over without waiting for the device."""
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # int32, all bits 1: nothing masked
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, row)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits


def accepted(matcher: xgr.GrammarMatcher, token: int) -> str:
    """Feed ``token`` to ``matcher``: "" while the match goes on, "stop" once it has ended (an eos token after a
    whole match), "error" for a token the grammar does not allow (never sampled from masked logits)."""
    if not matcher.accept_token(token):
        return "error"
    return "stop" if matcher.is_terminated() else ""
