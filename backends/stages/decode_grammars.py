"""Decode's admissions with a structured output: each sequence's grammar compiles on a thread of its own (a new
grammar takes milliseconds to a second with a 150k-token vocabulary), neither on the stage link's reader, which must
never block (docs/design.md, invariant 1), nor on the decode loop, whose steps every stream waits for.

The admission still reaches the loop in order with the other commands (an abort after it finds it), carrying the
compile's ``Future``; the loop holds the sequence here until the future is done, then is woken with a command of its
own (``("compiled", seq_id, None)``) and lets it join the batch, or fails it alone.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from backends.ipc.protocol import DecodeAdmit
from backends.runtime.sampling.grammar import Grammars
from backends.stages.decode_seqs import RunningSeq


class GrammarCompiles:
    """Matchers made off the loop (``start``, on the caller's thread: the link's reader), and the sequences that
    wait for theirs (``hold``, ``ready``, ``drop``: the loop thread's). ``wake`` puts a command on the loop's
    queue."""

    def __init__(self, grammars: Grammars, wake: Callable[[tuple], None]):
        self.grammars = grammars
        self._wake = wake
        self._pool = ThreadPoolExecutor(1, "decode-grammar")
        self._waiting: dict[str, tuple[RunningSeq, Future]] = {}

    def start(self, admit: DecodeAdmit) -> Future | None:
        """The matcher of ``admit``'s structured output, having accepted its first token, made on the pool; None
        without one."""
        if admit.sampling.structured is None:
            return None
        return self._pool.submit(self._matcher, admit)

    def _matcher(self, admit: DecodeAdmit):
        matcher = self.grammars.matcher(admit.sampling.structured)
        if not matcher.accept_token(admit.last_token) or matcher.is_terminated():  # prefill ends it if it ends
            raise ValueError(f"its first token {admit.last_token} breaks or ends its grammar")
        return matcher

    def hold(self, seq: RunningSeq, future: Future) -> None:
        """Keep ``seq`` until ``future`` is done, then wake the loop for it."""
        self._waiting[seq.seq_id] = (seq, future)
        future.add_done_callback(lambda _: self._wake(("compiled", seq.seq_id, None)))

    def ready(self, seq_id: str) -> tuple[RunningSeq | None, str]:
        """On the loop's "compiled" command: the sequence with its matcher and "", the sequence and why its matcher
        could not be made, or (None, "") where it was dropped meanwhile (aborted)."""
        seq, future = self._waiting.pop(seq_id, (None, None))
        if seq is None:
            return None, ""
        try:
            seq.grammar = future.result()
        except Exception as exc:  # a ValueError from the grammar; anything else fails this sequence alone too
            return seq, str(exc) or type(exc).__name__
        return seq, ""

    def waiting(self, seq_id: str) -> RunningSeq | None:
        """The sequence held for its matcher, if it is."""
        return self._waiting.get(seq_id, (None, None))[0]

    def drop(self, seq_id: str | None = None) -> None:
        """Forget ``seq_id`` (every sequence: None); its compile's end wakes the loop for nothing."""
        if seq_id is None:
            self._waiting.clear()
        else:
            self._waiting.pop(seq_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
