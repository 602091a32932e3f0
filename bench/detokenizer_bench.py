"""What the orchestrator's detokenizer costs a token as a reply grows, with and without stop strings.

    python bench/detokenizer_bench.py --out DIR [--tokens 16000] [--stops 4]

Feeds one long reply (``--tokens`` ids of random lower-case text, the offline Qwen tokenizer) to
``orchestrator.detokenizer.Detokenizer`` one token at a time, with no stop string and with ``--stops`` of them that
never match, and times each quarter of the reply (microseconds a token). Beside it, the same with
:class:`SearchedFromTheStart`, the rule before 2026-12-06 (every call looked for each stop string in all the text
after the ``min_tokens`` part): its cost grew with the reply. Every request's tokens pass here on the orchestrator's
event loop, so a cost a token that grows with the reply holds every stream's tokens. A CPU figure of one process
(no server), not a speed claim against another system. Writes ``DIR/detokenizer.json``.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.runtime.tokenizer import build_offline_tokenizer  # noqa: E402
from bench.common import header, write  # noqa: E402
from orchestrator.detokenizer import Detokenizer  # noqa: E402

STOPS = ("</answer>", "Observation:", "\n\nUser:", "STOP", "###", "<|user|>", "\n\n\n", "END")
QUARTERS = 4


class SearchedFromTheStart(Detokenizer):
    """The detokenizer looking for its stop strings in all the text after the exempt part at every call (the rule
    before it looked only where the new text could end a match)."""

    def _release(self) -> str:
        self._searched = 0
        return super()._release()


def reply_ids(tokenizer, tokens: int, seed: int = 0) -> list[int]:
    """``tokens`` ids of random lower-case words, spaces and punctuation (no stop string of :data:`STOPS`)."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdefgh ijklmnop qrst uvwxyz,.") for _ in range(tokens * 6))
    return tokenizer(text)["input_ids"][:tokens]


def us_per_token(detok: Detokenizer, ids: list[int]) -> list[float]:
    """Microseconds a token over each quarter of ``ids``, fed one at a time."""
    quarter, out = len(ids) // QUARTERS, []
    for k in range(QUARTERS):
        started = time.perf_counter()
        for token in ids[k * quarter:(k + 1) * quarter]:
            detok.add([token])
        out.append(round((time.perf_counter() - started) / quarter * 1e6, 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--tokens", type=int, default=16000, help="the reply's length (tokens)")
    parser.add_argument("--stops", type=int, default=4, choices=range(1, len(STOPS) + 1), help="stop strings")
    args = parser.parse_args()
    tokenizer = build_offline_tokenizer()
    ids = reply_ids(tokenizer, args.tokens)
    stops = STOPS[:args.stops]
    runs = {name: us_per_token(kind(tokenizer, stop=stop), ids)
            for name, kind, stop in (("no_stop_strings", Detokenizer, ()), ("stop_strings", Detokenizer, stops),
                                     ("stop_strings_searched_from_the_start", SearchedFromTheStart, stops))}
    for name, quarters in runs.items():
        print(f"{name}: us a token by quarter of the reply {quarters}", flush=True)
    write(Path(args.out), "detokenizer", {**header(torch.device("cpu"), ("tokenizers",)), "tokens": len(ids),
                                          "stop_strings": list(stops), "us_per_token_by_quarter": runs})


if __name__ == "__main__":
    main()
