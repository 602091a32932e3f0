"""Other clients' names for ``sampling_parameters`` keys, read as the key wherever sampling_parameters' rules apply (a
request, the orchestrator's ``media_defaults``; the OpenAI API passes its ``mm_processor_kwargs`` on as they are).
Pure: no I/O."""
from __future__ import annotations

from types import MappingProxyType
from typing import Collection

from orchestrator.shown import shown

# alias -> (the key it stands for, whose name it is)
ALIASES = MappingProxyType({
    # vLLM 0.26's InternVL processor (`InternVLProcessor.resolve_min_max_num`'s arguments, its mm_processor_kwargs)
    "max_dynamic_patch": ("max_tiles", "vLLM's InternVL"),
    "min_dynamic_patch": ("min_tiles", "vLLM's InternVL"),
    # transformers 5.17's InternVL image processor (GotOcr2ImageProcessor's kwargs; vLLM passes them to it for an
    # InternVL `-hf` checkpoint)
    "max_patches": ("max_tiles", "transformers' InternVL"),
    "min_patches": ("min_tiles", "transformers' InternVL"),
    "crop_to_patches": ("dynamic_image_size", "transformers' InternVL"),
    "guided_decoding": ("structured_outputs", "vLLM's pre-0.11"),  # the Triton vLLM backend takes both
})


def key_of(name: str) -> str:
    """The key that ``name`` (a key, or one of ``ALIASES``) stands for."""
    return ALIASES[name][0] if name in ALIASES else name


def aliases_of(keys: Collection[str]) -> list[str]:
    """The aliases of ``keys``, in ``ALIASES``' order."""
    return [alias for alias, (key, _) in ALIASES.items() if key in keys]


def by_key(values: dict[str, object]) -> dict[str, object]:
    """``values`` (the names sent -> their values, converted) with each alias's value under its key; a null alias is
    dropped (not given). A key and its aliases sent together are one setting: equal values, or all but one null, pass.

    Raises ValueError naming the first two whose values differ, the key (or the first alias) first: ``max_tiles 2 and
    max_dynamic_patch 6 are one setting (max_dynamic_patch is vLLM's InternVL name for max_tiles): send one, or equal
    values``.
    """
    out = {name: value for name, value in values.items() if name not in ALIASES}
    named: dict[str, str] = {}  # key -> the alias whose value it holds
    for alias, (key, _) in ALIASES.items():
        value = values.get(alias)
        if value is None:
            continue
        if out.get(key) is None:
            out[key], named[key] = value, alias
        elif out[key] != value:
            first = named.get(key, key)
            whose = ", ".join(f"{name} is {ALIASES[name][1]} name for {key}" for name in (first, alias)
                              if name in ALIASES)
            raise ValueError(f"{first} {shown(out[key])} and {alias} {shown(value)} are one setting ({whose}): send "
                             "one, or equal values")
    return out
