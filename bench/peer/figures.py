"""Each scenario's figures for ``summary.json`` (issues 19 and 20), from its request records (ms unless named).

Records are ``RequestRecord.to_json()`` dicts: ``sent_s`` from the scenario's start, ``token_s`` after the send.
A TBT gap belongs to a window when the token that ends it arrives inside it. The mixed scenarios' window opens
when the burst (the video, or the 16 images) is sent and closes at the last first token of the burst: the time
the burst is encoded and prefilled beside the text streams' decode. The text-only TBT is that of the gaps that end
before the burst is sent. A stream's stall shows in its TBT only while its request runs: a new request of the stream
(the closed loop sends the next as the last ends) that waits behind the burst shows it as its TTFT, so the mixed
scenarios also give the text requests' TTFT max over those sent in the window, and the text tokens the streams got
per second of the window.

The cache scenarios (issue 21): ``followup``'s TTFT of the follow-up question alone (``ttft_ms``), of the first
question (cold) and of the follow-up as a chat; ``multiturn``'s prefix-cache hit rate, the server's hit tokens over
its looked-up tokens in the scenario (``prefix_hit_rate``; its counters' increase, ``bench.peer.prefix_cache``), and
the later questions' cached tokens over their prompt tokens, as each response's ``usage`` reports them
(``reusable_hit_rate``; vLLM reports them with ``--enable-prompt-tokens-details``: None without; it understates the
rate over the reusable tokens alone by the new question's share of the prompt, under 0.5% for these clips),
the TTFT p50 and p90 of the first questions and of the later ones, and the share of questions meeting both SLOs
(``bench.peer.slo``) with the fastest first question as every question's TTFT reference (``ttft_reference_ms``):
of either system in a two-system summary (``bench.peer.summary.ttft_references``), else the system's own; and that
share as the TTFT limit goes from 1x to 5x the reference (``slo_attainment_by_ttft_factor``).
"""
from __future__ import annotations

from bench.peer import slo
from bench.serve_bench import distribution


def _ok(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind and r.get("error") is None and r.get("token_s")]


def timed_gaps(records: list[dict]) -> list[tuple[float, float]]:
    """(arrival of the closing token in s from the scenario's start, TBT gap in ms) of every gap of ``records``."""
    out = []
    for r in records:
        times = [r["sent_s"] + t for t in r["token_s"]]
        out += [(b, (b - a) * 1e3) for a, b in zip(times, times[1:])]
    return out


def gaps_in(records: list[dict], start_s: float, end_s: float) -> list[float]:
    """TBT gaps (ms) of ``records`` whose closing token arrives in ``[start_s, end_s]`` (s from the scenario's
    start)."""
    return [gap for t, gap in timed_gaps(records) if start_s <= t <= end_s]


def burst_window(records: list[dict], burst_kind: str) -> tuple[float, float] | None:
    """(the burst's send, its last first token), s from the scenario's start; None when a burst request failed."""
    burst = [r for r in records if r["kind"] == burst_kind]
    firsts = [r["sent_s"] + r["token_s"][0] for r in burst if r.get("token_s")]
    if not burst or len(firsts) < len(burst):
        return None
    return min(r["sent_s"] for r in burst), max(firsts)


def _stat(values: list[float], key: str) -> float | None:
    d = distribution(values)
    return None if d is None else d[key]


def all_gaps(records: list[dict]) -> list[float]:
    """Every TBT gap (ms) of ``records``."""
    return [gap for _, gap in timed_gaps(records)]


def mixed(records: list[dict], burst_kind: str) -> dict:
    """Figures of a mixed scenario: text streams and a burst of ``burst_kind`` requests sent at one instant;
    ``text_tbt_window_ratio``: the window's text TBT p99 over the text-only p99 before it (the isolation target's
    ratio, issue 19 and 22), per pass, so that a median over passes is one pass's ratio."""
    text, window = _ok(records, "text"), burst_window(records, burst_kind)
    if window is None:  # not run, or a failed burst request leaves no window to judge
        return dict.fromkeys(("text_only_tbt_p99_ms", "text_tbt_window_p99_ms", "text_tbt_window_ratio",
                              "text_tbt_window_max_ms", "text_ttft_window_max_ms", "text_tokens_window_per_s",
                              f"{burst_kind}_ttft_max_ms"))
    inside, before = gaps_in(text, *window), gaps_in(text, float("-inf"), window[0])
    ttfts = [r["ttft_ms"] for r in records if r["kind"] == burst_kind]
    text_ttfts = [r["ttft_ms"] for r in text if window[0] <= r["sent_s"] <= window[1]]
    tokens = sum(window[0] <= r["sent_s"] + t <= window[1] for r in text for t in r["token_s"])
    only, window_p99 = _stat(before, "p99"), _stat(inside, "p99")
    return {"text_only_tbt_p99_ms": only, "text_tbt_window_p99_ms": window_p99,
            "text_tbt_window_ratio": window_p99 / only if only and window_p99 is not None else None,
            "text_tbt_window_max_ms": _stat(inside, "max"), "text_ttft_window_max_ms": _stat(text_ttfts, "max"),
            "text_tokens_window_per_s": tokens / (window[1] - window[0]) if window[1] > window[0] else None,
            f"{burst_kind}_ttft_max_ms": _stat(ttfts, "max")}


def followup(records: list[dict]) -> dict:
    """Figures of the followup scenario: the follow-up's TTFT alone, the first question's and the chat's (ms)."""
    ttft = {kind: _stat([r["ttft_ms"] for r in _ok(records, kind)], "max")
            for kind in ("first", "followup", "followup_chat")}
    return {"ttft_ms": ttft["followup"], "first_ttft_ms": ttft["first"], "chat_ttft_ms": ttft["followup_chat"]}


def question_of(record: dict) -> int:
    """The question's place (0 first) of a multiturn record (kind ``clip<k>_q<j>``)."""
    return int(record["kind"].rpartition("_q")[2])


def first_question_ttft(records: list[dict]) -> float | None:
    """The fastest (ms) error-free first question of a multiturn scenario's records, None without one."""
    first = [r["ttft_ms"] for r in records if r.get("error") is None and r.get("token_s") and question_of(r) == 0]
    return min(first) if first else None


def multiturn(records: list[dict], prefix_cache: dict | None, reference: dict[str, float] | None = None) -> dict:
    """Figures of the multiturn scenario; ``prefix_cache``: the server's counters' increase over it (``queries``,
    ``hits``, tokens), None where it has none (the hit rates are None then, as where it looked nothing up);
    ``reference``: the SLO's TTFT reference per kind (ms), by default the fastest first question of ``records``."""
    ok = [r for r in records if r.get("error") is None and r.get("token_s")]
    first = [r["ttft_ms"] for r in ok if question_of(r) == 0]
    later = [r["ttft_ms"] for r in ok if question_of(r) > 0]
    later_ok = [r for r in ok if question_of(r) > 0 and r.get("cached_tokens") is not None]
    reusable = sum(r.get("prompt_tokens") or 0 for r in later_ok)
    hits, queries = (prefix_cache or {}).get("hits"), (prefix_cache or {}).get("queries")
    if reference is None and (fastest := first_question_ttft(records)) is not None:
        reference = {r["kind"]: fastest for r in records}
    return {"prefix_hit_rate": hits / queries if hits is not None and queries else None,
            "reusable_hit_rate": sum(r["cached_tokens"] for r in later_ok) / reusable if reusable else None,
            "first_ttft_p50_ms": _stat(first, "p50"), "first_ttft_p90_ms": _stat(first, "p90"),
            "later_ttft_p50_ms": _stat(later, "p50"), "later_ttft_p90_ms": _stat(later, "p90"),
            "slo_attainment": slo.attainment(records, reference) if reference and ok else None,
            "ttft_reference_ms": min(reference.values()) if reference and ok else None,
            "slo_attainment_by_ttft_factor": {f"{factor}x": slo.attainment(records, reference, factor)
                                              for factor in slo.FACTORS} if reference and ok else None}


def scenario_figures(name: str, records: list[dict], prefix_cache: dict | None = None,
                     ttft_reference: dict[str, float] | None = None) -> dict:
    """The summary's figures of scenario ``name`` (None where it was not run: no records, or its requests failed);
    ``prefix_cache``: the server's prefix-cache counters' increase over it (multiturn's hit rates);
    ``ttft_reference``: multiturn's SLO reference per kind (ms), by default its own fastest first question. Raises
    ValueError for a scenario without summary figures (goodput, crosscheck)."""
    if name == "followup":
        return followup(records)
    if name == "multiturn":
        return multiturn(records, prefix_cache, ttft_reference)
    if name == "video":
        return {"ttft_ms": _stat([r["ttft_ms"] for r in _ok(records, "video")], "max")}
    if name == "mixed_video":
        m = mixed(records, "video")
        return {key: m[key] for key in ("text_only_tbt_p99_ms", "text_tbt_window_p99_ms", "text_tbt_window_ratio",
                                        "text_tbt_window_max_ms", "text_ttft_window_max_ms",
                                        "text_tokens_window_per_s")} | {"video_ttft_ms": m["video_ttft_max_ms"]}
    if name == "mixed_images":
        m = mixed(records, "image")
        return {key: m[key] for key in ("text_only_tbt_p99_ms", "text_tbt_window_p99_ms", "text_tbt_window_ratio",
                                        "text_ttft_window_max_ms", "text_tokens_window_per_s", "image_ttft_max_ms")}
    ttft = [r["ttft_ms"] for r in _ok(records, "image" if name == "images16" else "text")]
    if name == "text_c1":
        return {"ttft_ms": _stat(ttft, "p50"), "tbt_mean_ms": _stat(all_gaps(_ok(records, "text")), "mean")}
    if name in ("text_c32", "text_c32_structured"):
        gaps = all_gaps(_ok(records, "text"))
        return {"ttft_p50_ms": _stat(ttft, "p50"), "tbt_mean_ms": _stat(gaps, "mean"), "tbt_p99_ms": _stat(gaps, "p99")}
    if name == "images16":
        return {"ttft_p50_ms": _stat(ttft, "p50"), "ttft_max_ms": _stat(ttft, "max")}
    raise ValueError(f"no figures for scenario {name!r}")


def figures_line(name: str, records: list[dict]) -> str:
    """Scenario ``name``'s figures (:func:`scenario_figures`) as one line, ``key value`` with two decimals, those it
    could not compute left out; empty for a scenario without summary figures (goodput, crosscheck, the cache ones)."""
    try:
        figures = scenario_figures(name, records)
    except ValueError:  # a scenario of no summary figures
        return ""
    return ", ".join(f"{key} {value:.2f}" for key, value in figures.items() if isinstance(value, float))
