"""Tokenizers: a checkpoint's own, or an offline byte-level BPE with a family's special tokens and chat template.

Preset runs (no ``model_path``: seeded random weights) have no checkpoint to read a tokenizer from and nothing
can be downloaded, so :func:`build_offline_tokenizer` builds one in code with the ``tokenizers`` library. It
follows Qwen2's pipeline (NFC, Qwen's split regex, byte-level BPE; see
``transformers.models.qwen2.tokenization_qwen2``) with a tiny vocabulary: the 256 byte tokens, a few
merges, then the family's special tokens in its checkpoints' order (Qwen2.5-VL's by default; InternVL3's:
``families.internvl3``). The vocabulary is a literal, so every process gets the same ids.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerFast

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Byte-level symbols ("Ġ" is a space); a handful of English merges so that text is not all single bytes.
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("o", "n"), ("r", "e"),
           ("Ġ", "s"), ("a", "t"), ("e", "n"), ("o", "r")]

# Qwen's special tokens with ids 151643..151656 in Qwen2.5-VL's tokenizer, in that order.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# The chat template of Qwen2.5-VL-Instruct (its chat_template.json).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table in its own order (printable bytes first), as Qwen's vocabulary uses it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def build_offline_tokenizer(model_vocab_size: int | None = None, special_tokens: Sequence[str] = SPECIAL_TOKENS,
                            chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with ``special_tokens`` and ``chat_template`` (default: Qwen2.5-VL's).

    Vocabulary: 256 byte tokens (ids 0..255), ``len(_MERGES)`` merged tokens, then ``special_tokens``;
    ``len(tokenizer)`` is the model's ``vocab_size`` in the ``tiny`` presets. With ``model_vocab_size`` (e.g.
    Qwen's 151643), filler tokens take the ids up to it, so the special tokens get Qwen's own ids
    (151643..151656 for Qwen2.5-VL's): the ``tokenizers`` library numbers added tokens after the model
    vocabulary. The fillers are byte-level strings no merge builds, so encoding is unchanged and they decode to
    text (``" filler<id>"``).
    eos is ``<|im_end|>`` and pad ``<|endoftext|>``, as in Qwen2.5-VL-Instruct. Needs no files or network.
    Raises ValueError when ``model_vocab_size`` is smaller than the byte and merged tokens.
    """
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    if model_vocab_size is not None:
        if model_vocab_size < len(vocab):
            raise ValueError(f"model_vocab_size {model_vocab_size} is below the {len(vocab)} byte and merged tokens")
        vocab.update({f"Ġfiller{i}": i for i in range(len(vocab), model_vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        model_max_length=32768,
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_path: str | None, config: PreTrainedConfig | None = None) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer (``AutoTokenizer``, local files only; ``config``: the checkpoint's config when the
    caller has it, else ``AutoTokenizer`` reads config.json) or, for ``None``, Qwen2.5-VL's offline one (a preset of
    another family: ``families.registry.model_tokenizer``).

    Raises OSError when ``model_path`` is not a directory or holds no tokenizer (none of ``TOKENIZER_FILES``):
    transformers would look the name up as a Hub repository, or build a tokenizer without Qwen's special tokens.
    """
    if model_path is None:
        return build_offline_tokenizer()
    if not Path(model_path).is_dir():
        raise OSError(f"model_path {model_path!r} is not a directory (a local checkpoint)")
    if not any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
        raise OSError(f"{model_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
                      "checkpoint's tokenizer files there")
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True, config=config)


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """Ids of the tokens the runtime places or stops on.

    Keys: ``image_pad``, ``video_pad``, ``vision_start``, ``vision_end``, ``im_start``, ``im_end``,
    ``endoftext``. Raises KeyError when the tokenizer lacks one of them.
    """
    names = {"image_pad": "<|image_pad|>", "video_pad": "<|video_pad|>", "vision_start": "<|vision_start|>",
             "vision_end": "<|vision_end|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
             "endoftext": "<|endoftext|>"}
    vocab = tokenizer.get_vocab()
    missing = [token for token in names.values() if token not in vocab]
    if missing:
        raise KeyError(f"tokenizer has no special token(s) {missing}")
    return {key: vocab[token] for key, token in names.items()}


def eos_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a generation: ``<|im_end|>`` then ``<|endoftext|>`` (Qwen2.5-VL-Instruct's
    ``generation_config.eos_token_id``)."""
    ids = special_token_ids(tokenizer)
    return [ids["im_end"], ids["endoftext"]]
