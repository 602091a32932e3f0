"""Token ids -> text deltas, holding back incomplete UTF-8 and possible stop-string prefixes.

Byte-level BPE can split one character over several tokens; a delta is released only once it
decodes without U+FFFD at its end. The tokenizers library's ``DecodeStream`` does that per token (as vLLM's
fast incremental detokenizer does; about 1 us a token against 14 us for two windowed ``decode`` calls on the
CPU machine). Stop strings follow vLLM v1's ``IncrementalDetokenizer.update``:
they are not looked for while at most ``min_tokens`` tokens are out, and afterwards only where they
end in text that arrived later, so a stop string wholly inside the first ``min_tokens`` tokens' text
never ends the output. Each call looks only where a match could end in the text it brought (vLLM's search of the
new characters and a stop string's length before them): searched from the start each time, a 16,000-token reply
with four stop strings cost 37 us a token in its last quarter against 14 in its first on the CPU machine, now 10
(bench/detokenizer_bench.py; bench/results/detokenizer-cpu-2026-12-06/). With ``include_stop_str_in_output``
(vLLM's) a matched stop string stays in the text, which then ends after it, and nothing is held back for one (vLLM's
``stop_buffer_length`` of 0).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

WINDOW = 6  # tokens of left context at the end (flush): enough for any multi-token UTF-8 character


class Detokenizer:
    """Feed token ids with :meth:`add`; read ``text`` (everything released), ``stopped`` and ``matched`` (the stop
    string that ended the output, vLLM's ``stop_reason``; None while none has).

    ``stop``: strings that end the output (not in it unless ``include_stop``); ``min_tokens``: tokens that must be
    out before a stop string may end it (the request's ``min_tokens``, as for EOS); ``skip_special_tokens``: special
    tokens (``<|im_end|>``) have no text (vLLM's default) or their own.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer  # the tokenizers library's Tokenizer (a fast tokenizer's)
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._exempt = 0        # characters of _decoded produced within the first min_tokens tokens
        self._searched = 0      # characters of _decoded in which every stop string has been looked for
        self.ids: list[int] = []
        self.text = ""          # released text
        self._decoded = ""      # all text decoded so far (released + held back)
        self._offset = 0        # ids before this index are fully decoded into _decoded
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the output (``matched``)."""
        return self.matched is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly released text (may be ""). After a stop string matched,
        ``stopped`` is True and the text ends before it."""
        if self.stopped:
            return ""
        for token in token_ids:
            self.ids.append(token)
            piece = self._stream.step(self._backend, token)  # None: an incomplete character so far
            if piece:
                self._decoded += piece
                self._offset = len(self.ids)
        if len(self.ids) <= self.min_tokens:
            self._exempt = len(self._decoded)
        return self._release()

    def flush(self) -> str:
        """At the end: release what was held back (a possible stop-string prefix, an incomplete character)."""
        if self.stopped:
            return ""
        if self._offset < len(self.ids):  # an incomplete character at the very end: release it as U+FFFD
            start = max(0, self._offset - WINDOW)
            prefix = self._decode(self.ids[start:self._offset])
            self._decoded += self._decode(self.ids[start:])[len(prefix):]
            self._offset = len(self.ids)
        delta = self._decoded[len(self.text):]
        self.text = self._decoded
        return delta

    def _release(self) -> str:
        searched, self._searched = self._searched, len(self._decoded)
        for s in self.stop:
            # A match must end after the exempt text (it may start inside it, as in vLLM), and after the text
            # searched before (one ending there would have been found then).
            at = self._decoded.find(s, max(0, max(self._exempt, searched) - len(s) + 1))
            if at >= 0:
                self.matched = s
                end = at + len(s) if self.include_stop else at
                delta = self._decoded[len(self.text):end] if end > len(self.text) else ""
                self.text = self._decoded[:end] if end > len(self.text) else self.text
                return delta
        # Hold back a tail that could still grow into a stop string (that would not be in the text).
        hold = 0 if self.include_stop else max(
            (k for s in self.stop for k in range(1, len(s)) if self._decoded.endswith(s[:k])), default=0)
        end = len(self._decoded) - hold
        delta = self._decoded[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta
