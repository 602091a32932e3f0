"""Each prompt token's string, as ``/tokenize``'s ``return_token_strs`` gives it: the tokenizer's
``convert_ids_to_tokens``, looked up in a table of the whole vocabulary's tokens, built once, as UTF-8 bytes.

``convert_ids_to_tokens`` asks the tokenizers library for one id at a time in Python: on the CPU machine a 1-MiB
prompt's 786,000 ids took 181 ms, and making their UTF-8 bytes for the response another 52, both holding the
orchestrator's GIL (from the admission thread), while every stream's tokens waited for it. From the table the same
ids take 18 ms. The streams' stall beside such a request stays (bench/results/tokenize-stall-cpu-2026-12-06/): most
of what is left is the million-element ``input_tokens`` tensor's serialization, on both sides of gRPC.
"""
from __future__ import annotations

import threading
from typing import Iterable


class TokenStrings:
    """``of(ids)``: the tokens of ``ids`` (``tokenizer.convert_ids_to_tokens``) as UTF-8 bytes. The table of
    ``len(tokenizer)`` tokens is built at the first call (once, whichever thread calls); an id beyond it (none that
    admission lets through) is converted alone, None as empty bytes."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._table: list[bytes] | None = None
        self._lock = threading.Lock()

    def _built(self) -> list[bytes]:
        with self._lock:
            if self._table is None:
                tokens = self._tokenizer.convert_ids_to_tokens(list(range(len(self._tokenizer))))
                self._table = [(t or "").encode() for t in tokens]
            return self._table

    def of(self, ids: Iterable[int]) -> list[bytes]:
        table = self._built()
        size = len(table)
        return [table[i] if 0 <= i < size else self._alone(i) for i in ids]

    def _alone(self, token_id: int) -> bytes:
        return (self._tokenizer.convert_ids_to_tokens(token_id) or "").encode()
