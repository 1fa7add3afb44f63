"""The tokenizer a GGUF file describes in its metadata (tokenizer.ggml.*), built as a `tokenizers` object:
the vocabulary, merges and special tokens as llama.cpp stores them, split the way its pre-tokenizer names."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.engine.model.gguf_metadata import GgufMetadata

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the text split before byte-level BPE (llama.cpp's table, for the names it shares
# with the architectures the engine runs). Unlisted names take GPT-2's split.
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Pre-tokenizers that put every digit apart before GPT-2's split (SmolLM's and StarCoder's).
_DIGIT_SPLITS = ("smollm", "starcoder", "refact")


def tokenizer_from_gguf(metadata: GgufMetadata) -> Tokenizer:
    """ValueError when the file has no tokenizer, or one of a kind not built here."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None or metadata.get("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{metadata.path.name} has no tokenizer in its metadata: pass --tokenizer")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model) in {metadata.path.name}: "
                         f"pdserve builds 'gpt2' (byte-level BPE) ones; pass --tokenizer with its tokenizer.json")
    return _byte_level_bpe(metadata)


def _byte_level_bpe(metadata: GgufMetadata) -> Tokenizer:
    tokens = list(metadata.get("tokenizer.ggml.tokens"))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or ()]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or ())
    # Kept whole in text rather than cut into pieces: control tokens as special, user-defined ones (<think>)
    # as plain added tokens.
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                  for i, kind in enumerate(types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                          for i, kind in enumerate(types) if kind == _USER_DEFINED])
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return tokenizer


def _pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    if name in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGIT_SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def gguf_special_tokens(metadata: GgufMetadata) -> dict[str, str]:
    """bos_token, eos_token, unk_token and pad_token by text, as chat templates see them."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    out = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            out[f"{name}_token"] = tokens[token_id]
    return out
