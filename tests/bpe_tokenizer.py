"""A small byte-level BPE tokenizer trained in memory for the tests that need text (stop strings,
structured output): ids 0-2 are <unk>, <s>, </s>, so </s> is the tiny preset's EOS (2)."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN_ID = 2
_CORPUS = [
    '{"name": "red", "ok": true, "count": 12, "color": "green"}',
    "the quick brown fox jumps over the lazy dog; stop here. end of story",
] * 50


def bpe_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    assert tokenizer.token_to_id("</s>") == EOS_TOKEN_ID
    return tokenizer
