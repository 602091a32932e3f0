"""Model repositories with some ``config.pbtxt`` parameters changed, without editing the repo's own.

``parse_overrides(["decode.kv_pages=8192", "*.dtype=bfloat16"])`` turns the launcher's ``--set``
items into ``{model: {key: value}}`` (the served model's keys, :data:`MODEL_WIDE`, go to every stage);
:func:`repository_with` writes a copy of the repository with those values (the tests,
``python -m backends.triton.launcher --set ...`` and ``bench/serve_bench.py`` use it).
Only parameters that the repository already declares can be set: a misspelt model or key is an error
before any server starts, not a silently ignored value. So is a value the model could not load with, as
far as the repository says: a parameter written as an integer takes an integer, and the sizes and counts
(``triton_io.POSITIVE_INT_PARAMETERS``) one of at least 1.
"""
from __future__ import annotations

import os
import py_compile
import re
from pathlib import Path

from backends.triton.replicas import REPLICATED_STAGES, replica_name
from backends.triton.triton_io import (POSITIVE_FLOAT_PARAMETERS, choice_value, float_parameter, float_requirement,
                                       int_value)

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"

# One Triton model parameter on one line, as our config.pbtxt files write them:
#   parameters { key: "dtype" value { string_value: "float32" } }
_PARAMETER = re.compile(r'(parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value\s*\{\s*string_value:\s*)'
                        r'"(?P<value>(?:[^"\\]|\\.)*)"')


def _models(source: Path) -> list[Path]:
    return sorted(d for d in source.iterdir() if (d / "config.pbtxt").is_file())


def _parameter_lines(config: str):
    """(line index, match) of each parameter line; commented-out lines are not parameters."""
    for n, line in enumerate(config.splitlines(keepends=True)):
        if not line.lstrip().startswith("#"):
            match = _PARAMETER.search(line)
            if match:
                yield n, match


def model_parameters(source: Path = REPOSITORY) -> dict[str, dict[str, str]]:
    """``{model: {key: value}}`` of the string parameters in each ``<source>/<model>/config.pbtxt``
    (values as written, pbtxt escapes kept)."""
    return {d.name: {m["key"]: m["value"] for _, m in _parameter_lines((d / "config.pbtxt").read_text())}
            for d in _models(source)}


# Settings of the served model, not of one stage: the stages must load one model (and decode's shared weights tell
# encode_prefill whether to hold a language model of its own), so naming one model sets every model that declares it.
MODEL_WIDE = ("preset", "model_path", "load_format", "dtype", "seed", "share_weights")


def model_wide_conflicts(source: Path) -> list[str]:
    """The :data:`MODEL_WIDE` keys that the models of repository ``source`` set to different values (one line each:
    ``"KEY: MODEL 'VALUE', ..."``; ``model_path`` compared as a normalized path), or ``[]``. Such a repository was
    edited by hand (the launcher's ``--set`` sets every model): a stage loading another model, seed or dtype than the
    other makes wrong tokens, not an error, and a ``share_weights`` of decode's that encode_prefill does not share
    leaves encode_prefill without the weights it waits for."""
    values: dict[str, dict[str, str]] = {}
    for model, params in model_parameters(source).items():
        for key in MODEL_WIDE:
            if key in params:
                values.setdefault(key, {})[model] = params[key].strip()

    def same(key: str, value: str) -> str:
        return os.path.normpath(value) if key == "model_path" and value else value
    return [f"{key}: " + ", ".join(f"{model} {value!r}" for model, value in by_model.items())
            for key, by_model in values.items() if len({same(key, v) for v in by_model.values()}) > 1]


def parse_overrides(items: list[str], source: Path = REPOSITORY,
                    origins: list[str | None] | None = None) -> dict[str, dict[str, str]]:
    """``MODEL.KEY=VALUE`` items -> ``{model: {key: value}}``; ``*.KEY=VALUE``, and ``MODEL.KEY=VALUE`` for a key of
    :data:`MODEL_WIDE`, set KEY in every model of ``source`` that declares it. Later items win over earlier ones.
    ``origins``: where each item came from, what its error starts with (a deployment file's key, ``--model``; None:
    ``--set 'ITEM'``).

    Raises ValueError, naming the item's origin, for a malformed item, an unknown model, a key the model does not
    declare, a ``*`` key that no model declares (the message lists what exists), or a value that
    :func:`check_value` refuses.
    """
    declared = model_parameters(source)
    overrides: dict[str, dict[str, str]] = {}
    for n, item in enumerate(items):
        origin = (origins[n] if origins else None) or f"--set {item!r}"
        target, eq, value = item.partition("=")
        model, dot, key = target.partition(".")
        if not (eq and dot and model and key):
            raise ValueError(f"{origin}: expected MODEL.KEY=VALUE (or *.KEY=VALUE)")
        everywhere = [m for m, keys in declared.items() if key in keys]
        if model == "*":
            models = everywhere
            if not models:
                known = sorted({k for keys in declared.values() for k in keys})
                raise ValueError(f"{origin}: no model has a parameter {key!r}; parameters: {', '.join(known)}")
        elif model not in declared:
            raise ValueError(f"{origin}: no model {model!r} in {source}; models: {', '.join(declared)}")
        elif key not in declared[model]:
            raise ValueError(f"{origin}: model {model!r} has no parameter {key!r}; "
                             f"its parameters: {', '.join(declared[model])}")
        else:
            models = everywhere if key in MODEL_WIDE else [model]
        for m in models:
            try:
                check_value(m, key, declared[m][key], value)
            except ValueError as exc:
                raise ValueError(f"{origin}: {exc}") from None
            overrides.setdefault(m, {})[key] = value
    return overrides


def check_value(model: str, key: str, current: str, value: str) -> None:
    """Refuses ``value`` for ``model``'s parameter ``key`` when ``current`` (its value in config.pbtxt) is an
    integer and ``value`` is not (empty included), or is below 1 for a size or below 0 for a count
    (``triton_io.int_value``); or when the parameter takes one of a few words (``triton_io.CHOICES``) and ``value``
    is none of them; or when it is a positive number when set (``triton_io.POSITIVE_FLOAT_PARAMETERS``: the SLO
    targets) and ``value`` is neither empty nor one. Other parameters are checked by their model at load.

    Raises ValueError naming MODEL.KEY and the value given.
    """
    choice_value(key, value, f"{model}.{key}")
    if key in POSITIVE_FLOAT_PARAMETERS:
        try:
            float_parameter({key: value}, key)
        except ValueError:
            raise ValueError(f"{model}.{key} must be {float_requirement(key)} (or empty: unset), got {value!r}") \
                from None
    try:
        int(current)
    except ValueError:
        return
    int_value(key, value, f"{model}.{key}")


def _quoted(value: str) -> str:
    """``value`` as a protobuf text-format string (a line break escaped: the format's strings hold none)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def edited_config(config: str, values: dict[str, str], model: str = "model") -> str:
    """``config`` (a config.pbtxt's text) with each parameter ``key`` set to ``values[key]``.
    Raises ValueError when a key is not declared (exactly once) in ``config``."""
    lines = config.splitlines(keepends=True)
    found = {key: 0 for key in values}
    for n, match in list(_parameter_lines(config)):
        key = match["key"]
        if key in values:
            found[key] += 1
            lines[n] = lines[n][:match.start()] + match[1] + _quoted(values[key]) + lines[n][match.end():]
    bad = {key: count for key, count in found.items() if count != 1}
    if bad:
        raise ValueError(f"{model}: parameters not declared exactly once in config.pbtxt: {bad}")
    return "".join(lines)


def repository_with(target: Path, parameters: dict[str, dict[str, str]], source: Path = REPOSITORY) -> Path:
    """A copy of the model repository ``source`` in ``target`` (created; must not hold the models yet) with
    ``parameters[model][key]`` set in the models' config.pbtxt. Returns ``target``.

    When the orchestrator's ``replicas`` is N > 1, the copy also holds replicas 1 .. N-1 of the encode_prefill
    and decode models (``backends/triton/replicas.py``): the same configs and overrides under the names
    ``<model>_r<k>``, with ``replica`` k. Other files are symbolic links to ``source``'s, so each model.py still
    finds the repo root through its resolved path. Raises ValueError for a model not in ``source`` or a key its
    config does not declare.
    """
    models = {d.name: d for d in _models(source)}
    unknown = sorted(set(parameters) - set(models))
    if unknown:
        raise ValueError(f"no model {', '.join(map(repr, unknown))} in {source}; models: {', '.join(models)}")
    for name, model_dir in models.items():
        _write_model(target, model_dir, name, parameters.get(name, {}))
    declared = model_parameters(source).get("orchestrator", {}).get("replicas", "1")
    replicas = int(parameters.get("orchestrator", {}).get("replicas", declared))
    for k in range(1, replicas):
        for stage in REPLICATED_STAGES:
            values = {**parameters.get(stage, {}), "replica": str(k)}
            _write_model(target, models[stage], replica_name(stage, k), values)
    return target


def _write_model(target: Path, model_dir: Path, name: str, values: dict[str, str]) -> None:
    """``model_dir`` as model ``name`` in ``target``: its config with ``values`` set (and ``name``), links to the
    rest of its files, and each linked ``.py`` file's bytecode in the ``__pycache__`` beside it, compiled now by this
    Python. The stub imports model.py from its version folder and writes that bytecode at the first load unless it
    is there: the repository then changed under Triton, so ``--model-control-mode=poll`` reloaded all four models at
    its first poll (their second instances could not bind the stages' sockets, and tritonserver 2.51 crashed), and
    in explicit mode loading a loaded model again was a real reload that failed (a fresh user's test, 2026-12-06).
    The stub runs this Python where the launcher found the pip wheel's (its stub is for this version); a stub of
    another Python version writes its own file at the first load all the same."""
    config = edited_config((model_dir / "config.pbtxt").read_text(), values, name)
    config, renamed = re.subn(r'^name:\s*"[^"]*"', f'name: "{name}"', config, count=1, flags=re.MULTILINE)
    if not renamed:
        raise ValueError(f"{model_dir / 'config.pbtxt'} has no name line")
    (target / name).mkdir(parents=True)
    (target / name / "config.pbtxt").write_text(config)
    for path in sorted(model_dir.rglob("*")):
        if path == model_dir / "config.pbtxt" or not path.is_file() or "__pycache__" in path.parts:
            continue
        link = target / name / path.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path.resolve())
        if link.suffix == ".py":  # checked against the linked file's size and time, as the stub's import checks it
            py_compile.compile(str(link), doraise=True)  # into __pycache__ beside it, as the import names it
