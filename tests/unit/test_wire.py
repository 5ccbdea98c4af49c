"""Every node-to-node message: encode -> decode gives the value back, and each
decoder refuses a malformed field with a message that names it."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from mooncaked.cache.hashing import block_hashes
from mooncaked.engine.handoff import PrefillReply
from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import (
    MAX_KV_READY_IN_S,
    Handoff,
    KVLayout,
    PrefillOffer,
    PrefillSource,
    PrefillTarget,
    Retain,
)
from mooncaked.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from mooncaked.rpc import Target
from mooncaked.transfer import Access, SegmentDescriptor
from mooncaked.wire.calls import decode_identity, encode_identity
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.generate import GenerateBody
from mooncaked.wire.handoff import decode_grant, decode_offer, decode_target, encode_grant
from mooncaked.wire.lease import (
    LookupAnswer,
    LookupBody,
    ReleaseAnswer,
    ReleaseBody,
)
from mooncaked.wire.prefill import PrefillBody, decode_prefill_reply, encode_prefill_reply
from mooncaked.wire.request import (
    decode_output,
    decode_sampling,
    encode_output,
    encode_sampling,
)
from tests.unit.test_late_binding import GRANT as LATE_BINDING_GRANT

SAMPLING = SamplingParams(
    max_tokens=8,
    temperature=0.5,
    top_k=4,
    top_p=0.9,
    seed=-3,
    stop=("\n\n",),
    stop_token_ids=(2, 7),
    ignore_eos=True,
    logprobs=2,
)
OFFER = PrefillOffer(1.0, 0.25, 0.5, 0.5)
SOURCE = PrefillSource(
    (PrefillTarget("p1", "http://p1:8000", True, OFFER), PrefillTarget("p2", "http://p2", False)),
    hop_s=0.01,
)
# The late-binding tests' grant, over more blocks of a wider layout.
GRANT = dataclasses.replace(
    LATE_BINDING_GRANT,
    layout=KVLayout(num_layers=2, num_blocks=8, block_size=16, row_bytes=64),
    first_block=1,
    block_ids=(3, 4, 7),
)
LOGPROB = TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)])
SEGMENT = SegmentDescriptor(
    "holder", "kv.dram", 4096, "cpu", ("shm", "tcp"), "127.0.0.1:9001", Access.READ
)
HASHES = tuple(block_hashes(list(range(48)), 16, "test-model"))

GENERATE = GenerateBody("r1~2", [1, 2, 3], SAMPLING, SOURCE, output_offset=2, kv_ready_in_s=0.25)
PREFILL = PrefillBody("r1", [1, 2, 3], SAMPLING, GRANT, peer_fetch=False, max_wait_s=1.5)
LOOKUP = LookupBody(HASHES, 4096, b"\x01\x02", "decode-1", 10.0)
LOOKUP_ANSWER = LookupAnswer("holder", 7, (0, 4096, 8192), 10.0, 4096, SEGMENT, "127.0.0.1:9001")


def doc(message: Any) -> dict[str, Any]:
    """A message as its receiver parses it."""
    return orjson.loads(message.encode())


@pytest.mark.parametrize(
    "message",
    [
        GENERATE,
        GenerateBody("r1", [1], SamplingParams()),
        GenerateBody("r1", [1], SamplingParams(), retain=Retain(600.0, 2)),
        PREFILL,
        PrefillBody("r1", [1], SamplingParams(), GRANT),
        PrefillBody("r1", [1], SamplingParams(), GRANT, retain=Retain(30.0, 1)),
        LOOKUP,
        LOOKUP_ANSWER,
        LookupAnswer("holder", 0, (), 0.0, 4096, SEGMENT, "127.0.0.1:9001"),
        ReleaseBody(3),
        ReleaseAnswer(False),
    ],
    ids=lambda m: type(m).__name__,
)
def test_each_message_round_trips(message: Any) -> None:
    assert type(message).decode(doc(message)) == message


def test_values_of_other_layers_round_trip() -> None:
    assert decode_sampling(encode_sampling(SAMPLING)) == SAMPLING
    assert decode_grant(encode_grant(GRANT)) == GRANT
    for i, target in enumerate(SOURCE.targets):
        assert decode_target(doc(GENERATE)["prefill"][i]) == target
    out = RequestOutput(
        "r1",
        [5, 6],
        " hi",
        True,
        FinishReason.LENGTH,
        [LOGPROB],
        num_prompt_tokens=3,
        num_cached_tokens=16,
        num_output_tokens=2,
        error=None,
        prefill_node="p1",
    )
    line = encode_output(out)
    assert line.endswith(b"\n") and decode_output(line) == out
    reply = PrefillReply("p1", SampledToken(5, LOGPROB), num_cached_tokens=16, bytes_sent=4096)
    assert decode_prefill_reply(encode_prefill_reply(reply)) == reply
    plain = PrefillReply("p1", SampledToken(5, None), num_cached_tokens=0)
    assert decode_prefill_reply(encode_prefill_reply(plain)) == plain
    me = Target("rack/7", 1_700_000_000_000)
    assert decode_identity(orjson.loads(encode_identity(me))) == me


def test_the_wire_form_is_the_one_nodes_already_speak() -> None:
    """Field names and shapes other versions of the daemon send and read."""
    assert doc(GENERATE) == {
        "request_id": "r1~2",
        "prompt_token_ids": [1, 2, 3],
        "sampling": encode_sampling(SAMPLING),
        "prefill": [
            {
                "node_id": "p1",
                "url": "http://p1:8000",
                "fetch": True,
                "offer": [1.0, 0.25, 0.5, 0.5],
            },
            {"node_id": "p2", "url": "http://p2", "fetch": False},
        ],
        "hop_s": 0.01,
        "output_offset": 2,
        "kv_ready_in_s": 0.25,
    }
    assert doc(PREFILL)["grant"]["layout"] == [2, 8, 16, 64]
    assert doc(PREFILL)["max_wait_s"] == 1.5
    # No limit is no field.
    assert "max_wait_s" not in doc(PrefillBody("r1", [1], SamplingParams(), GRANT))
    assert orjson.loads(encode_prefill_reply(PrefillReply("p1", SampledToken(5), 0))) == {
        "node_id": "p1",
        "token": [5, None],
        "num_cached_tokens": 0,
        "bytes": 0,
    }


def test_decoded_calls_give_the_engine_its_handoff() -> None:
    handoff = GENERATE.handoff(now=100.0)
    assert handoff == Handoff(source=SOURCE, kv_ready_at=100.25, output_offset=2)
    # Without prefill nodes the KV-ready forecast means nothing.
    alone = GenerateBody("r1", [1], SamplingParams(), kv_ready_in_s=3.0)
    assert alone.handoff(now=100.0) == Handoff(kv_ready_at=0.0)
    assert PREFILL.handoff() == Handoff(sink=GRANT, peer_fetch=False)
    assert LOOKUP_ANSWER.offer("http://holder").segment == "kv.dram"  # type: ignore[union-attr]
    assert LookupAnswer("h", 0, (), 0.0, 1, SEGMENT, "a").offer("http://holder") is None


def test_kv_ready_in_s_is_a_bounded_number_of_seconds() -> None:
    for ok in (0, 1.25, MAX_KV_READY_IN_S):
        assert GenerateBody.decode(doc(GENERATE) | {"kv_ready_in_s": ok}).kv_ready_in_s == ok
    for bad in (-0.1, MAX_KV_READY_IN_S + 1, math.nan, math.inf, True, "1", None, [1]):
        with pytest.raises(ValueError, match="'kv_ready_in_s' must be a number of seconds") as exc:
            GenerateBody.decode(doc(GENERATE) | {"kv_ready_in_s": bad})
        assert repr(bad) in str(exc.value)


def test_offers_travel_as_four_numbers_and_bad_ones_are_refused() -> None:
    assert decode_offer(OFFER.to_list()) == OFFER
    for bad in ([1.0, 0.2, 0.5], [1.0, -1.0, 0.5, 0.0], [1.0, math.inf, 0.5, 0.0], "x", [True] * 4):
        with pytest.raises(ValueError, match="'offer"):
            decode_offer(bad)


def changed(base: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """``base`` with the field at ``path`` set to ``value`` (``...``: removed)."""
    out = copy.deepcopy(base)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


Decoder = Callable[[dict[str, Any]], Any]
MALFORMED: list[tuple[Decoder, dict[str, Any], tuple[str | int, ...], Any, str]] = [
    (GenerateBody.decode, doc(GENERATE), ("request_id",), "", "request_id"),
    (GenerateBody.decode, doc(GENERATE), ("request_id",), "x" * 257, "request_id"),
    (GenerateBody.decode, doc(GENERATE), ("prompt_token_ids",), [], "prompt_token_ids"),
    (GenerateBody.decode, doc(GENERATE), ("prompt_token_ids",), [1, "2"], "prompt_token_ids"),
    (GenerateBody.decode, doc(GENERATE), ("prompt_token_ids",), [True], "prompt_token_ids"),
    (GenerateBody.decode, doc(GENERATE), ("output_offset",), -1, "output_offset"),
    (GenerateBody.decode, doc(GENERATE), ("hop_s",), 61.0, "hop_s"),
    (GenerateBody.decode, doc(GENERATE), ("hop_s",), "0", "hop_s"),
    (GenerateBody.decode, doc(GENERATE), ("prefill",), {"node_id": "p1"}, "prefill"),
    (GenerateBody.decode, doc(GENERATE), ("prefill", 0), "p1", "prefill[0]"),
    (GenerateBody.decode, doc(GENERATE), ("prefill", 0, "node_id"), ..., "prefill[0].node_id"),
    (GenerateBody.decode, doc(GENERATE), ("prefill", 1, "url"), 5, "prefill[1].url"),
    (GenerateBody.decode, doc(GENERATE), ("prefill", 0, "fetch"), "no", "prefill[0].fetch"),
    (GenerateBody.decode, doc(GENERATE), ("prefill", 0, "offer"), [1, 2], "prefill[0].offer"),
    (GenerateBody.decode, doc(GENERATE), ("sampling",), [], "sampling"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "best_of"), 2, "sampling"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "max_tokens"), 0, "sampling.max_tokens"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "temperature"), None, "sampling.temperature"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "top_p"), 0.0, "sampling.top_p"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "top_k"), True, "sampling.top_k"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "stop"), [1], "sampling.stop"),
    (GenerateBody.decode, doc(GENERATE), ("sampling", "logprobs"), 21, "sampling.logprobs"),
    (
        GenerateBody.decode,
        doc(GENERATE),
        ("sampling", "stop_token_ids"),
        ["x"],
        "sampling.stop_token_ids",
    ),
    (PrefillBody.decode, doc(PREFILL), ("max_wait_s",), -1.0, "max_wait_s"),
    (PrefillBody.decode, doc(PREFILL), ("max_wait_s",), "soon", "max_wait_s"),
    (PrefillBody.decode, doc(PREFILL), ("peer_fetch",), 1, "peer_fetch"),
    (PrefillBody.decode, doc(PREFILL), ("grant",), None, "grant"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "layout"), [1, 2, 3], "grant.layout"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "layout", 0), 0, "grant.layout[0]"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "block_ids"), [], "grant.block_ids"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "block_ids"), [8], "grant.block_ids"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "ttl_s"), 0, "grant.ttl_s"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "ttl_s"), 3601, "grant.ttl_s"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "segment"), "", "grant.segment"),
    (PrefillBody.decode, doc(PREFILL), ("grant", "first_block"), -1, "grant.first_block"),
    (PrefillBody.decode, doc(PREFILL), ("request_id",), 7, "request_id"),
    (LookupBody.decode, doc(LOOKUP), ("hashes",), ["zz"], "hashes"),
    (LookupBody.decode, doc(LOOKUP), ("layout",), "not hex", "layout"),
    (LookupBody.decode, doc(LOOKUP), ("block_bytes",), "4096", "block_bytes"),
    (LookupBody.decode, doc(LOOKUP), ("reader",), "", "reader"),
    (LookupBody.decode, doc(LOOKUP), ("ttl_s",), 0, "ttl_s"),
    (LookupAnswer.decode, doc(LOOKUP_ANSWER), ("offsets",), [-1], "offsets"),
    (LookupAnswer.decode, doc(LOOKUP_ANSWER), ("lease_id",), "7", "lease_id"),
    (LookupAnswer.decode, doc(LOOKUP_ANSWER), ("segment",), None, "segment"),
    (LookupAnswer.decode, doc(LOOKUP_ANSWER), ("segment", "name"), ..., "segment"),
    (LookupAnswer.decode, doc(LOOKUP_ANSWER), ("transfer_address",), None, "transfer_address"),
    (ReleaseBody.decode, doc(ReleaseBody(3)), ("lease_id",), 0, "lease_id"),
    (ReleaseBody.decode, doc(ReleaseBody(3)), ("lease_id",), True, "lease_id"),
    (ReleaseAnswer.decode, doc(ReleaseAnswer(True)), ("released",), "yes", "released"),
    (decode_identity, {"node_id": "n1", "generation": 5}, ("generation",), 0, "generation"),
    (decode_identity, {"node_id": "n1", "generation": 5}, ("node_id",), None, "node_id"),
]


@pytest.mark.parametrize(
    ("decode", "base", "path", "value", "name"),
    MALFORMED,
    ids=[f"{d.__qualname__}:{n}={v!r:.20}" for d, _, _, v, n in MALFORMED],
)
def test_decoders_refuse_a_malformed_field_by_name(
    decode: Decoder, base: dict[str, Any], path: tuple[str | int, ...], value: Any, name: str
) -> None:
    decode(base)  # the unchanged message is fine
    with pytest.raises(ValueError) as exc:
        decode(changed(base, path, value))
    assert repr(name) in str(exc.value), str(exc.value)


def test_output_lines_refuse_malformed_fields_by_name() -> None:
    out = orjson.loads(encode_output(RequestOutput("r1", [5], "a", False, logprobs=[LOGPROB])))
    for path, value, name in [
        (("new_token_ids",), [-1], "new_token_ids"),
        (("finished",), 1, "finished"),
        (("finish_reason",), "done", "finish_reason"),
        (("logprobs", 0), [5, -0.1], "logprobs[0]"),
        (("logprobs", 0, 1), "x", "logprobs[0].logprob"),
        (("text",), None, "text"),
        (("error",), 3, "error"),
    ]:
        with pytest.raises(ValueError) as exc:
            decode_output(orjson.dumps(changed(out, path, value)))
        assert repr(name) in str(exc.value), str(exc.value)
    for junk in (b"", b"[1]", b"{not json"):
        with pytest.raises(ValueError, match="an output line"):
            decode_output(junk)
    with pytest.raises(ValueError, match="'token'"):
        decode_prefill_reply(b'{"node_id": "p1", "token": 5, "num_cached_tokens": 0}')


def test_an_error_body_is_parsed_once_whatever_came_back() -> None:
    busy = ErrorAnswer("queue too long", code="prefill_busy")
    assert orjson.loads(busy.encode()) == {
        "error": {"message": "queue too long", "type": "internal_rpc_error", "code": "prefill_busy"}
    }
    assert ErrorAnswer.decode(busy.encode()) == busy
    assert "code" not in orjson.loads(ErrorAnswer("gone").encode())["error"]
    # The public API's shape reads the same.
    public = b'{"error": {"message": "m", "type": "rate_limit_exceeded", "param": null, "code": "queue_full"}}'
    assert ErrorAnswer.decode(public) == ErrorAnswer("m", "rate_limit_exceeded", "queue_full")
    # Anything else (a proxy's page, a cut body) is its own message, cut short.
    page = ErrorAnswer.decode(b"<html>" + b"x" * 1000)
    assert page.message.startswith("<html>") and len(page.message) == 300 and page.code is None
    assert ErrorAnswer.decode(b'{"error": "no"}').message == '{"error": "no"}'
