"""The public API's body checks, without a server, an engine or a tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.protocol import (
    chat_messages,
    check_chars,
    check_model,
    completion_prompt,
    parse_cache,
    parse_generation,
    parse_slo,
    parse_stream,
)
from mooncaked.cluster.slo import Slo
from mooncaked.handoff import Retain
from mooncaked.request import SamplingParams

PROMPT = [1, 2, 3, 4]


def refused(call: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as exc:
        call(*args, **kwargs)
    return exc.value


def completion(body: dict[str, Any], max_model_len: int = 64) -> Any:
    return parse_generation(
        body, PROMPT, parse_stream(body), chat=False, max_model_len=max_model_len
    )


def chat(body: dict[str, Any], max_model_len: int = 64) -> Any:
    return parse_generation(
        body, PROMPT, parse_stream(body), chat=True, max_model_len=max_model_len
    )


def test_a_completion_body_becomes_sampling_parameters() -> None:
    parsed = completion(
        {
            "max_tokens": 8,
            "temperature": 0,
            "top_k": -1,
            "stop": "\n",
            "stop_token_ids": [2],
            "seed": 7,
            "logprobs": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "slo": {"ttft_ms": 500, "tbt_ms": 50},
        }
    )
    assert parsed.sampling == SamplingParams(
        max_tokens=8,
        temperature=0.0,
        top_k=0,
        seed=7,
        stop=("\n",),
        stop_token_ids=(2,),
        ignore_eos=True,
        logprobs=2,
    )
    assert (parsed.stream, parsed.include_usage, parsed.logprobs_style) == (
        True,
        True,
        "completion",
    )
    assert parsed.slo == Slo(0.5, 0.05) and parsed.prompt_token_ids == PROMPT
    # Defaults: 16 tokens, no logprobs, no SLO of its own.
    plain = completion({})
    assert plain.sampling.max_tokens == 16 and plain.logprobs_style is None and plain.slo is None


def test_chat_takes_the_rest_of_the_context_by_default() -> None:
    assert chat({}, max_model_len=64).sampling.max_tokens == 60
    assert chat({"max_completion_tokens": 5, "max_tokens": 9}).sampling.max_tokens == 5
    parsed = chat({"logprobs": True, "top_logprobs": 3})
    assert parsed.sampling.logprobs == 3 and parsed.logprobs_style == "chat"
    full = refused(chat, {}, max_model_len=4)
    assert (full.status, full.param, full.code) == (400, "messages", "context_length_exceeded")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 2}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"user": 5}, "user"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"slo": {"ttft_ms": -1}}, "slo"),
        ({"slo": {"p99": 1}}, "slo"),
        ({"slo": 5}, "slo"),
        ({"cache": 600}, "cache"),
        ({"cache": {"retain_s": 60, "ttl": 1}}, "cache"),
        ({"cache": {"replicas": 2}}, "cache.retain_s"),
        ({"cache": {"retain_s": 0}}, "cache.retain_s"),
        ({"cache": {"retain_s": "600"}}, "cache.retain_s"),
        ({"cache": {"retain_s": 1e9}}, "cache.retain_s"),
        ({"cache": {"retain_s": True}}, "cache.retain_s"),
        ({"cache": {"retain_s": 60, "replicas": 0}}, "cache.replicas"),
        ({"cache": {"retain_s": 60, "replicas": 2.0}}, "cache.replicas"),
        ({"cache": {"retain_s": 60, "replicas": 17}}, "cache.replicas"),
    ],
)
def test_a_bad_completion_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    err = refused(completion, body)
    assert (err.status, err.param) == (400, param), err.message
    assert f"'{param}" in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_a_bad_chat_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    err = refused(chat, body)
    assert (err.status, err.param) == (400, param), err.message


def test_too_long_for_the_context_names_the_prompt_and_the_limit() -> None:
    err = refused(completion, {"max_tokens": 61}, max_model_len=64)
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "65 were requested (4 in the prompt, 61 for the completion)" in err.message
    assert completion({"max_tokens": 60}, max_model_len=64).sampling.max_tokens == 60


def test_the_model_must_be_the_one_served() -> None:
    check_model({}, "m")
    check_model({"model": "m"}, "m")
    other = refused(check_model, {"model": "gpt-4"}, "m")
    assert (other.status, other.code, other.param) == (404, "model_not_found", "model")
    assert refused(check_model, {"model": 4}, "m").status == 400


def test_completion_prompts_are_text_or_token_ids() -> None:
    assert completion_prompt({"prompt": "hi"}, None) == "hi"
    assert completion_prompt({"prompt": ["hi"]}, None) == "hi"
    assert completion_prompt({"prompt": [[5, 6]]}, 10) == [5, 6]
    assert completion_prompt({"prompt": [5, 6]}, None) == [5, 6]
    for body, code in [
        ({}, "missing_required"),
        ({"prompt": [5, 10]}, "invalid_value"),
        ({"prompt": ["a", "b"]}, "invalid_value"),
        ({"prompt": 5}, "invalid_value"),
        ({"prompt": [True]}, "invalid_value"),
    ]:
        err = refused(completion_prompt, body, 10)
        assert (err.status, err.param, err.code) == (400, "prompt", code), body


def test_chat_messages_become_text_for_the_template() -> None:
    messages = chat_messages(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    for body, param in [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ]:
        err = refused(chat_messages, body)
        assert (err.status, err.param) == (400, param), body


def test_a_text_that_cannot_fit_is_refused_before_tokenizing() -> None:
    check_chars(64 * 10, 10, "prompt")
    err = refused(check_chars, 64 * 10 + 1, 10, "messages")
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")


def test_slo_in_milliseconds_becomes_seconds() -> None:
    assert parse_slo({}) is None
    assert parse_slo({"slo": {"ttft_ms": 250}}) == Slo(0.25, 0.0)


def test_cache_asks_for_the_prompt_to_be_retained() -> None:
    assert parse_cache({}) is None
    assert parse_cache({"cache": {"retain_s": 600}}) == Retain(600.0, 1)
    assert parse_cache({"cache": {"retain_s": 0.5, "replicas": 3}}) == Retain(0.5, 3)
    parsed = parse_generation(
        {"cache": {"retain_s": 60, "replicas": 2}},
        PROMPT,
        (False, False),
        chat=True,
        max_model_len=64,
    )
    assert parsed.retain == Retain(60.0, 2)
