"""Trains the built-in presets' byte-level BPE tokenizers and writes them (tokenizer.json +
tokenizer_config.json with a chat template) under shared/engine/model/presets/<preset>/.

The training text is the project's own sources and docs, so the result is reproducible from a
checkout. Each tokenizer has exactly the preset's vocab size (reserved special tokens fill whatever
BPE did not learn), so every id the model can sample decodes.
Run from the repo root: `python scripts/make_preset_tokenizers.py`."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.engine.model.model_config import LARGE_PRESETS, PRESETS
from shared.engine.model.preset_files import PRESET_TOKENIZERS as OUT

ROOT = Path(__file__).resolve().parent.parent
# Ids 0..2 match the presets' pad/bos/eos ids (model_config: bos 1, eos 2).
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_files() -> list[str]:
    files = sorted(ROOT.glob("**/*.md")) + sorted(ROOT.glob("**/*.py"))
    return [str(f) for f in files if ".venv" not in f.parts and "_pb2" not in f.name]


def train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(training_files(), trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer


def main() -> None:
    for name, config in PRESETS.items():
        if name in LARGE_PRESETS:
            continue  # token ids only
        directory = OUT / name
        directory.mkdir(parents=True, exist_ok=True)
        # Compact JSON: the reserved tokens alone are 22,100 records in the 100m preset.
        train(config.vocab_size).save(str(directory / "tokenizer.json"), pretty=False)
        tokenizer_config = {
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
            "model_max_length": config.max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        print(f"{name}: {config.vocab_size} tokens -> {directory}")


if __name__ == "__main__":
    main()
