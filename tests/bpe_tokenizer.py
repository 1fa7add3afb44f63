"""A byte-level BPE tokenizer trained in memory (well under a second) for the tests that need text (stop
strings, structured output). Its 4096 tokens cover the tiny preset's whole vocabulary, so every token the
model samples has text, and ids 0-2 are <unk>, <s>, </s>: </s> is the tiny preset's EOS (2)."""
from __future__ import annotations

import functools
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN_ID = 2
VOCAB_SIZE = 4096


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9))) for _ in range(3000)]
    lines = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(400)]
    return lines + ["the quick brown fox jumps over the lazy dog; stop here. end of story"] * 20


@functools.cache
def _trained_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    assert tokenizer.token_to_id("</s>") == EOS_TOKEN_ID and tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer.to_str()


def bpe_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(_trained_json())
