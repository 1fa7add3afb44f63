"""Text out of streamed tokens: multi-byte characters split across tokens and stream chunks come out
whole, one left incomplete at the end comes out as U+FFFD the way transformers' decode() renders it, the
CLI never prints token ids inside text, and every service loads tokenizers through one loader."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.cli import chunk_output
from shared.engine.tokenizer import load_tokenizer
from shared.serving.text import TextCodec, TextStream


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (GPT-2's byte-to-character map, no merges): every character of more than
    one byte is split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


TEXT = "añ 日本 🙂!"


def test_characters_split_across_chunks_come_out_whole(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT).ids
    assert len(ids) == len(TEXT.encode())
    stream = TextStream(byte_tokenizer)
    pieces = [stream.push([token_id], final=i == len(ids) - 1) for i, token_id in enumerate(ids)]
    assert "".join(pieces) == TEXT
    assert "\ufffd" not in "".join(pieces)
    # "日" is 3 bytes: nothing for its first two tokens, the whole character with the third.
    start = len("añ ".encode())
    assert pieces[start:start + 3] == ["", "", "日"]


@pytest.mark.parametrize("num_bytes_kept", [1, 2, 3])
def test_an_incomplete_character_at_the_end_is_kept_as_replacement_like_decode(byte_tokenizer, num_bytes_kept):
    ids = byte_tokenizer.encode("ab🙂").ids[: 2 + num_bytes_kept]  # 🙂 is 4 bytes: cut inside it
    expected = byte_tokenizer.decode(ids)  # what transformers' decode() gives (it is this library's decode)
    assert expected.startswith("ab") and expected.endswith("\ufffd")
    stream = TextStream(byte_tokenizer)
    streamed = stream.push(ids[:2]) + stream.push(ids[2:3]) + stream.push(ids[3:], final=True)
    assert streamed == expected


def test_final_push_without_tokens_flushes_the_held_back_bytes(byte_tokenizer):
    ids = byte_tokenizer.encode("x日").ids[:2]
    stream = TextStream(byte_tokenizer)
    assert stream.push(ids) == "x"
    assert stream.push([], final=True) == byte_tokenizer.decode(ids)[1:] == "\ufffd"


def test_cli_prints_text_for_text_prompts_and_ids_only_for_id_prompts():
    waiting = SimpleNamespace(text="", token_ids=[229, 151])  # a character not complete yet
    done = SimpleNamespace(text="日", token_ids=[165])
    assert chunk_output(waiting, as_text=True) == ""
    assert chunk_output(done, as_text=True) == "日"
    assert chunk_output(waiting, as_text=False) == "229 151 "


def test_one_tokenizer_loader_for_files_and_model_directories(byte_tokenizer, tmp_path):
    byte_tokenizer.save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path)):
        assert load_tokenizer(path).encode("añ").ids == byte_tokenizer.encode("añ").ids
    assert TextCodec.from_path(str(tmp_path)).encode("añ") == byte_tokenizer.encode("añ").ids
    empty = tmp_path / "model-without-tokenizer"
    empty.mkdir()
    assert load_tokenizer(empty, required=False) is None
    with pytest.raises(ValueError, match="tokenizer file not found"):
        load_tokenizer(empty)
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(empty, required=False)


def test_token_bytes_rebuild_text_split_mid_character():
    """Logprobs' bytes: a token holding part of a character has its own bytes, byte-level BPE (GPT-2,
    Llama 3, Qwen) and SentencePiece's byte fallback (Llama 2, Mistral) alike."""
    from tokenizers import Tokenizer, decoders, models

    codec = TextCodec.from_path("tiny")
    text = "日本語 héllo 🙂"
    ids = codec.encode(text)
    assert "\ufffd" in "".join(codec.token_texts(ids))  # the texts alone lose the split characters
    assert b"".join(codec.token_bytes(ids)).decode() == text
    sentencepiece = Tokenizer(models.BPE(vocab={"<0xE6>": 0, "\u2581hi": 1, "<unk>": 2}, merges=[], byte_fallback=True,
                                         unk_token="<unk>"))
    sentencepiece.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
    assert TextCodec(sentencepiece).token_bytes([0, 1]) == [b"\xe6", b" hi"]
