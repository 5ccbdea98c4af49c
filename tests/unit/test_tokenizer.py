from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncaked.engine.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)
from tests.hf_fixtures import write_tokenizer

TEXT = "héllo wörld, 世界! 🎉 ok\nnew line"


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    return pieces


# ---------------------------------------------------------------- byte tokenizer


def test_byte_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id
    assert ids[1:] == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_special_tokens=False) == list(TEXT.encode("utf-8"))


def test_byte_specials_in_text_and_decode() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("<|user|>hi<|end|></s>", add_special_tokens=False)
    assert ids == [259, ord("h"), ord("i"), 261, 257]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|></s>"
    assert tok.eos_token_ids == (257,)
    # Unused ids of the vocab decode to nothing.
    assert tok.decode([ord("a"), 300, ord("b")]) == "ab"
    assert tok.token_str(ord("a")) == "a"
    assert tok.token_str(257) == "</s>"


def test_byte_incremental_never_splits_a_character() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # "é" is two bytes: its first byte alone yields nothing.
    assert pieces[0] == "h"
    assert pieces[1] == ""
    assert pieces[2] == "é"
    # The 4-byte emoji appears whole, on its last byte.
    start = TEXT.encode("utf-8").index("🎉".encode())
    assert pieces[start : start + 4] == ["", "", "", "🎉"]


def test_byte_incremental_multi_token_pushes_and_flush_of_a_partial_char() -> None:
    tok = ByteTokenizer()
    data = "a世b".encode()
    detok = IncrementalDetokenizer(tok)
    # "a" + the first byte of 世: held back until the character completes.
    assert detok.push(list(data[:2])) == ""
    assert detok.push(list(data[2:4])) == "a世"
    assert detok.push([]) == ""
    assert detok.push(list(data[4:])) == "b"
    assert detok.push([0xE4]) == ""  # a dangling lead byte waits
    assert detok.flush() == "\ufffd"


def test_byte_incremental_skips_specials() -> None:
    tok = ByteTokenizer()
    pieces = _stream(tok, [256, ord("x"), 257])
    assert "".join(pieces) == "x"


def test_long_stream_stays_exact() -> None:
    tok = ByteTokenizer()
    text = ("abc déf 世界 " * 800).strip()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert out == text


# ---------------------------------------------------------------- chat templates


def test_builtin_chat_template() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("hi<|end|>")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [256, 258]
    # OpenAI content parts are joined.
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert "<|user|>ab<|end|>" in tok.apply_chat_template(parts)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list"),
        ([], "empty"),
        (["hi"], "object"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content"),
    ],
)
def test_malformed_messages_are_rejected(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ByteTokenizer().apply_chat_template(messages)  # type: ignore[arg-type]


# ---------------------------------------------------------------- tokenizer.json


def test_hf_word_level_tokenizer(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path, extra_eos_token_ids=[2, 5])
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, 5)
    assert tok.encode("w0 w1") == [1, 6, 7]
    assert tok.decode([1, 6, 7, 2]) == "w0 w1"
    text = tok.apply_chat_template([{"role": "user", "content": "w2"}])
    assert text == "<s>user: w2\nassistant:"
    # The template's raise_exception surfaces as a ValueError.
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    assert "".join(_stream(tok, [6, 7, 8])) == "w0 w1 w2"


def _byte_level_bpe(model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["hello world", "the quick brown fox", "héllo wörld", "日本語のテキスト"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    chatml = (
        "{% for message in messages %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": chatml})
    )


def test_hf_byte_level_incremental_detokenization(tmp_path: Path) -> None:
    _byte_level_bpe(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == (2,)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # Characters outside the training corpus are split into byte tokens.
    assert len(ids) > len(TEXT.split())
    pieces = _stream(tok, ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_chat_template_renders_like_transformers(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    _byte_level_bpe(tmp_path)
    ours = HFTokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    theirs.chat_template = ours.chat_template
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    for gen in (True, False):
        expected = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template(msgs)
    assert ours.encode(rendered, add_special_tokens=False)[0] == 1  # <|im_start|>


def test_hf_tokenizer_needs_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path)


def test_metaspace_stream_keeps_the_leading_space_after_the_prompt(tmp_path: Path) -> None:
    # SentencePiece-style (Llama 2, Mistral): "▁" marks a word start and the
    # decoder drops it at the very start of a decode.
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    hf = HFTokenizer(tmp_path)
    assert hf.decode([2, 3]) == "world!"  # what a stream without context would show

    detok = IncrementalDetokenizer(hf, prompt_ids=hf.encode("Hello"))
    assert detok.push([2]) + detok.push([3, 4]) + detok.flush() == " world! again"
