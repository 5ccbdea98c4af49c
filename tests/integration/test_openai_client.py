"""The official ``openai`` client against a real mooncaked subprocess."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def client(daemon) -> Iterator[openai.OpenAI]:  # type: ignore[no-untyped-def]
    # No retries: an error must surface as the daemon sent it.
    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield c
    finally:
        c.close()


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion_streams(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    common = dict(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    whole = client.chat.completions.create(**common)

    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    # Greedy: streaming and not streaming give the same text.
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 12


def test_completion_non_stream(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "text_completion"
    assert resp.model == MODEL
    (choice,) = resp.choices
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert resp.usage is not None
    # The builtin byte tokenizer: one token per byte plus BOS.
    assert resp.usage.prompt_tokens == len(b"Once upon a time") + 1
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_errors_reach_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    assert bad.value.param == "temperature"
    assert "temperature" in bad.value.message
