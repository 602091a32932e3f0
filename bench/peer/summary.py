"""``summary.json`` and ``report.json`` of the peer benchmark, from its raw records (``<out>/raw/<system>/*.json``).

``summary.json`` holds issue 19's Targets keys: ``date``, ``device``, ``versions``, ``model`` (``run.py --model``;
null for runs before it) and per system
``video.ttft_ms``; ``mixed_video.{text_only_tbt_p99_ms, text_tbt_window_p99_ms, text_tbt_window_max_ms,
video_ttft_ms}``; ``mixed_images.{text_tbt_window_p99_ms, image_ttft_max_ms}`` (and both mixed scenarios'
``text_ttft_window_max_ms`` and ``text_tokens_window_per_s``: the stall a text request sent in the window sees, and
what the streams got; their ``text_only_tbt_p99_ms`` and ``text_tbt_window_ratio``, the isolation ratio,
``bench.peer.figures``);
``goodput.{long_video, video, images}.max_rate_rps``; and issue 20's ``text_c1.{ttft_ms, tbt_mean_ms}``,
``text_c32.{ttft_p50_ms, tbt_mean_ms, tbt_p99_ms}``, ``images16.{ttft_p50_ms, ttft_max_ms}``; issue 21's
``followup.ttft_ms`` (with ``first_ttft_ms``, ``chat_ttft_ms``) and ``multiturn.prefix_hit_rate`` (with
``reusable_hit_rate``, the first and later questions' TTFT p50 and p90, ``slo_attainment``: ``bench.peer.figures``);
``text_c32_structured``'s as ``text_c32``'s (ms unless named; null where a scenario was not run or its requests failed; a fixed scenario run in several passes,
``run.py --passes``: each figure's median over them). ``report.json`` holds what backs them (every pass's figures
and load-generator loop lag under ``passes``: a pass whose client fell behind is seen there):
per system and scenario the request and error counts, the server's command line, whether its requests asked for
their timelines (``timelines``: ``run.py --no-timelines``), its prefix-cache counters' increase
(``bench.peer.prefix_cache``), the prompt tokens per request kind (both systems must count the same) and,
for UnifiedServe, the decode stage's mean step and batch from its metrics beside the clients' TBT mean and each of
its processes' CPU time as a share of the scenario (``bench.peer.process_cpu``), and for both the GPU's busy share
(``bench.peer.gpu_busy``) and the load generator's own loop lag (``bench.peer.client_loop``, its stalls left out),
the goodput runs' best unloaded TTFT per request type, requests per rate and attainment tables (``bench.peer.slo``;
each SLO's TTFT reference is shared by the systems: :func:`ttft_references`; ``own_reference`` gives the same with
each system's own best unloaded TTFT as the reference, the rule of runs before 2026-12-02),
the cross-check against ``vllm bench serve``, and every summary figure as UnifiedServe's over vLLM's
(:func:`ratios`). The plots: ``bench.peer.plots``; UnifiedServe's steps and timelines: ``bench.peer.timelines``.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.common import write
from bench.peer import figures, slo
from bench.peer.plots import write_plots
from bench.peer.scenarios import CACHED, FEATURES, FIXED, WORKLOADS
from bench.peer.timelines import write_timelines
from bench.peer.servers import SYSTEMS


def raw_stem(scenario: str, index: int = 1) -> str:
    """The raw file's name (no ``.json``) of pass ``index`` of ``scenario`` (``run.py --passes``): the first is the
    scenario's own name (``@`` as ``_at_``), a later one ``<name>.pass<index>``."""
    stem = scenario.replace("@", "_at_")
    return stem if index == 1 else f"{stem}.pass{index}"


def load_raw(out: Path) -> tuple[dict[str, dict[str, dict]], dict[str, dict[str, list[dict]]]]:
    """(``{system: {scenario: raw JSON of its first pass}}``, ``{system: {scenario: [every pass's raw JSON, in pass
    order]}}``) from ``out/raw`` (a raw JSON's ``pass``: its index, 1 where absent)."""
    passes: dict[str, dict[str, list[dict]]] = {}
    for path in sorted((out / "raw").glob("*/*.json")):
        data = json.loads(path.read_text())
        passes.setdefault(data["system"], {}).setdefault(data["scenario"], []).append(data)
    for runs in passes.values():
        for datas in runs.values():
            datas.sort(key=lambda d: d.get("pass", 1))
    first = {system: firsts for system, runs in passes.items()
             if (firsts := {name: datas[0] for name, datas in runs.items() if datas[0].get("pass", 1) == 1})}
    return first, passes


def median_figures(per_pass: list[dict]) -> dict:
    """Each figure's median over ``per_pass`` (one scenario's figures per pass, ``figures.scenario_figures``, at
    least one); None where a pass has none (its requests failed, or none fell where the figure looks)."""
    return {key: (statistics.median(values) if None not in (values := [f[key] for f in per_pass]) else None)
            for key in per_pass[0]}


def ttft_references(raw: dict[str, dict[str, dict]]) -> dict[str, dict[str, float]]:
    """The TTFT references (ms) of the SLOs, one per request kind and shared by the systems, so that both are judged
    against the same SLO (a reference of each system's own would make the faster system's SLO the stricter):
    ``<workload>`` the goodput workload's best unloaded TTFT per kind over every system's unloaded pass
    (``bench.peer.slo.best_unloaded_ttft``); ``multiturn`` the fastest first question of either system
    (``bench.peer.figures.first_question_ttft``), under each multiturn kind."""
    refs: dict[str, dict[str, float]] = {}
    for workload in WORKLOADS:
        unloaded = [r for runs in raw.values() for r in runs.get(f"goodput_{workload}@unloaded", {}).get("records", [])]
        if unloaded:
            refs[workload] = slo.best_unloaded_ttft(unloaded)
    firsts = [t for runs in raw.values() if (t := figures.first_question_ttft(runs.get("multiturn", {}).get(
        "records", []))) is not None]
    if firsts:
        refs["multiturn"] = {r["kind"]: min(firsts) for runs in raw.values()
                             for r in runs.get("multiturn", {}).get("records", [])}
    return refs


def goodput(runs: dict[str, dict], workload: str, best: dict[str, float] | None = None
            ) -> tuple[float | None, dict]:
    """(goodput in requests/s, its report) of ``workload`` from one system's raw scenarios; ``best``: the TTFT
    reference per request kind (``ttft_references``), by default this system's best unloaded TTFT."""
    unloaded = runs.get(f"goodput_{workload}@unloaded")
    rated = {float(name.partition("@")[2]): data["records"] for name, data in runs.items()
             if name.startswith(f"goodput_{workload}@") and not name.endswith("@unloaded")}
    if unloaded is None or not rated:
        return None, {"note": "not run (needs the unloaded pass and at least one rate)"}
    best = best or slo.best_unloaded_ttft(unloaded["records"])
    missing = {r["kind"] for records in rated.values() for r in records} - set(best)
    if missing:  # a type whose unloaded requests all failed cannot be judged
        return None, {"note": f"no unloaded TTFT for request types {sorted(missing)}", "best_unloaded_ttft_ms": best}
    by_rate = {rate: slo.attainment(records, best) for rate, records in rated.items()}
    return slo.goodput(by_rate), {
        "best_unloaded_ttft_ms": best, "requests_per_rate": {str(r): len(v) for r, v in sorted(rated.items())},
        "errors_per_rate": {str(r): sum(x.get("error") is not None for x in v) for r, v in sorted(rated.items())},
        "attainment": slo.attainment_table(rated, best), "slo": {"ttft_factor": slo.TTFT_FACTOR,
                                                                "tbt_p99_ms": slo.TBT_P99_SLO_MS}}


def system_figures(runs: dict[str, dict], references: dict[str, dict[str, float]] | None = None,
                   passes: dict[str, list[dict]] | None = None) -> tuple[dict, dict]:
    """(the system's summary figures, its report); ``references``: the SLOs' shared TTFT references
    (``ttft_references``), by default the system's own; ``passes``: every pass's raw JSON per scenario
    (``load_raw``): a fixed scenario run more than once has each figure's median over its passes in the summary and
    every pass's requests, errors and figures in the report (``passes``; ``scenarios`` holds the first pass's)."""
    references, passes = references or {}, passes or {}
    summary: dict = {}
    report: dict = {"scenarios": {}, "goodput": {}, "passes": {}}
    for name in FIXED + CACHED + FEATURES:
        data = runs.get(name, {})
        summary[name] = figures.scenario_figures(name, data.get("records", []), data.get("prefix_cache"),
                                                 references.get(name))
        if name in FIXED and len(passes.get(name, ())) > 1:
            per_pass = [figures.scenario_figures(name, d.get("records", [])) for d in passes[name]]
            summary[name] = median_figures(per_pass)
            report["passes"][name] = [{"requests": len(d.get("records", [])),
                                       "errors": sum(r.get("error") is not None for r in d.get("records", [])),
                                       "figures": f, **_client_loop(d)} for d, f in zip(passes[name], per_pass)]
    for name, data in runs.items():
        if "records" in data:
            records = data["records"]
            tokens: dict[str, list[int]] = {}
            for r in records:
                tokens.setdefault(r["kind"], [])
                if r.get("prompt_tokens") is not None and r["prompt_tokens"] not in tokens[r["kind"]]:
                    tokens[r["kind"]].append(r["prompt_tokens"])
            report["scenarios"][name] = {"requests": len(records),
                                         "errors": sum(r.get("error") is not None for r in records),
                                         "prompt_tokens": tokens,
                                         **{key: data[key] for key in ("server_metrics", "process_busy", "gpu_busy",
                                                                       "prefix_cache", "server_argv", "timelines")
                                            if data.get(key) is not None}, **_client_loop(data)}
        elif name == "crosscheck":
            report["crosscheck"] = {k: v for k, v in data.items() if k in ("workload", "vllm_bench_serve", "ours",
                                                                           "ours_over_vllm_bench")}
    summary["goodput"] = {}
    for workload in WORKLOADS:
        rate, report["goodput"][workload] = goodput(runs, workload, references.get(workload))
        summary["goodput"][workload] = {"max_rate_rps": rate}
        if references.get(workload) and "attainment" in report["goodput"][workload]:
            own_rate, own = goodput(runs, workload)
            report["goodput"][workload]["own_reference"] = {"max_rate_rps": own_rate,
                                                            "best_unloaded_ttft_ms": own["best_unloaded_ttft_ms"],
                                                            "attainment": own.get("attainment")}
    return summary, report


def _client_loop(data: dict) -> dict:
    """``{"client_loop": ...}``: a raw run's load-generator loop lag without its stalls (``bench.peer.client_loop``;
    a pass whose client fell behind shows it here), or nothing for a run without one."""
    loop = data.get("client_loop")
    return {"client_loop": {k: v for k, v in loop.items() if k != "stalls"}} if loop else {}


def ratios(systems: dict[str, dict]) -> dict[str, dict[str, float]]:
    """UnifiedServe's figure over vLLM's, per scenario and figure both have (a number, vLLM's not 0): the form every
    comparison takes (below 1 is UnifiedServe lower: faster for times, fewer for rates and tokens/s)."""
    if len(systems) < 2:
        return {}
    ours, theirs = (_flat(systems[s]) for s in SYSTEMS)
    out: dict[str, dict[str, float]] = {}
    for (scenario, key), value in ours.items():
        other = theirs.get((scenario, key))
        if isinstance(value, (int, float)) and isinstance(other, (int, float)) and other:
            out.setdefault(scenario, {})[key] = round(value / other, 3)
    return out


def _flat(figures_of: dict) -> dict[tuple[str, str], object]:
    """(scenario, figure) -> value; a nested figure (goodput's ``video.max_rate_rps``) named with a dot."""
    return {(scenario, f"{key}.{sub}" if isinstance(value, dict) else key): v
            for scenario, figures in figures_of.items() for key, value in figures.items()
            for sub, v in (value.items() if isinstance(value, dict) else [(None, value)])}


def prompt_tokens_agree(reports: dict[str, dict]) -> dict[str, bool]:
    """Per scenario both systems ran: whether they counted the same prompt tokens for each request kind."""
    if len(reports) < 2:
        return {}
    a, b = (reports[s]["scenarios"] for s in SYSTEMS)
    return {name: a[name]["prompt_tokens"] == b[name]["prompt_tokens"] for name in sorted(set(a) & set(b))}


def write_summary(out: Path) -> Path:
    """Write ``out/summary.json``, ``out/report.json`` and the plots (``bench.peer.plots``) from ``out/raw``;
    returns the summary's path. Raises FileNotFoundError when no raw records are there."""
    raw, passes = load_raw(out)
    if not raw:
        raise FileNotFoundError(f"no raw records under {out / 'raw'}: run some scenarios first")
    first = next(iter(next(iter(raw.values())).values()))
    versions = dict(first["versions"])
    systems, reports = {}, {}
    references = ttft_references(raw)
    for system in SYSTEMS:
        if system in raw:
            systems[system], reports[system] = system_figures(raw[system], references, passes[system])
            versions[system] = next(iter(raw[system].values())).get("server_version")
    summary = {"date": first["date"], "device": first["device"], "versions": versions,
               "model": first.get("peer_model"), "systems": systems}
    write(out, "report", {"systems": reports, "prompt_tokens_agree": prompt_tokens_agree(reports),
                          "unifiedserve_over_vllm": ratios(systems), "smoke": first.get("smoke")})
    write_plots(out, raw, reports)
    write_timelines(out, raw.get("unifiedserve", {}))
    return write(out, "summary", summary)
