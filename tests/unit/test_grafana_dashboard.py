"""docker/grafana/unifiedserve.json: valid JSON whose every query names series the server exports (the metric
names written in backends/ and orchestrator/, histograms by their _bucket/_sum/_count series), and whose quantiles
are taken over buckets by ``le``."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from backends.stages.decode_stage import STEP_SECONDS
from backends.triton.histograms import SUFFIXES
from orchestrator.metrics import HISTOGRAMS

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"unifiedserve_[a-z0-9_]+")


def exported() -> set[str]:
    """Every series name the code can export: the names written as strings in backends/ and orchestrator/, with each
    histogram's name replaced by its three series."""
    names = set()
    for path in [*ROOT.glob("backends/**/*.py"), *ROOT.glob("orchestrator/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                names.add(node.value)
    histograms = {*HISTOGRAMS, STEP_SECONDS.name}
    return (names - histograms) | {h + suffix for h in histograms for suffix in SUFFIXES}


def test_every_query_names_an_exported_series():
    dashboard = json.loads((ROOT / "docker/grafana/unifiedserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 12
    known = exported()
    assert {"unifiedserve_time_to_first_token_seconds_bucket", "unifiedserve_kv_cache_usage_perc",
            "unifiedserve_videos_decoded_total"} <= known
    for expr in exprs:
        names = NAME.findall(expr)
        assert names and set(names) <= known, expr
        if "histogram_quantile" in expr:
            assert all(n.endswith("_bucket") for n in names) and re.search(r"by \(le\b", expr), expr
