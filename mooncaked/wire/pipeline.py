"""The calls between the stages of a pipelined prefill group, their bodies and client.

- ``POST /internal/pipeline/open`` (stage ``s`` -> stage ``s + 1``, signed):
  take part in a request (``StageOpen``). The stage opens the rest of the
  chain first, so that the group agrees on the prefix every stage holds,
  sets rows aside for its input and answers as NDJSON: a first line
  ``{"start", "act"}`` (where computing starts, the ``ActGrant`` its input
  is to be written into), then once its part and every later stage's is
  done a last line ``{"token", "bytes"}`` (the first sampled token, the KV
  bytes the stages wrote) or ``{"error"}``. Closing the connection aborts
  the request on that stage and every later one. Refusals: 409 with code
  ``prefill_busy`` (no rows or blocks for it), 409 (not that stage), 400.
- ``POST /internal/pipeline/chunk`` (stage ``s`` -> ``s + 1``, signed): a
  chunk's activations are in the granted rows (``ChunkNotice``); 409 for
  one out of order, sent twice or outside the grant.

Activations never travel here: they are written through the transfer
engine, these calls only say where and when.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.engine.pipeline import StageError
from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import ActGrant, KVGrant, StageRef
from mooncaked.request import SamplingParams
from mooncaked.rpc import Target, signed_headers
from mooncaked.wire import fields
from mooncaked.wire.errors import ErrorAnswer
from mooncaked.wire.handoff import (
    MAX_GRANT_BLOCKS,
    decode_grant,
    decode_stages,
    encode_grant,
    encode_stage,
)
from mooncaked.wire.paths import PIPELINE_CHUNK_PATH, PIPELINE_OPEN_PATH
from mooncaked.wire.request import (
    decode_logprob,
    decode_prompt,
    decode_sampling,
    encode_logprob,
    encode_sampling,
)

# Largest prompt position a call names.
_MAX_POS = 1 << 30
_ACT_NAMES = ("node_id", "url", "request_id", "transfer_address", "segment")


def encode_act(grant: ActGrant) -> dict[str, Any]:
    return {
        **{key: getattr(grant, key) for key in _ACT_NAMES},
        "row_bytes": grant.row_bytes,
        "block_rows": grant.block_rows,
        "block_ids": list(grant.block_ids),
        "start": grant.start,
    }


def decode_act(raw: Any, name: str = "act") -> ActGrant:
    d = fields.obj(raw, name)
    return ActGrant(
        node_id=fields.text(d.get("node_id"), f"{name}.node_id"),
        url=fields.text(d.get("url"), f"{name}.url", 2048),
        request_id=fields.text(d.get("request_id"), f"{name}.request_id"),
        transfer_address=fields.text(d.get("transfer_address"), f"{name}.transfer_address"),
        segment=fields.text(d.get("segment"), f"{name}.segment"),
        row_bytes=fields.integer(d.get("row_bytes"), f"{name}.row_bytes", 1, 1 << 24),
        block_rows=fields.integer(d.get("block_rows"), f"{name}.block_rows", 1, 1 << 16),
        block_ids=tuple(
            fields.integers(
                d.get("block_ids"), f"{name}.block_ids", min_len=1, max_len=MAX_GRANT_BLOCKS
            )
        ),
        start=fields.integer(d.get("start"), f"{name}.start", 0, _MAX_POS),
    )


@dataclass(frozen=True, slots=True)
class StageOpen:
    """Stage ``index`` of ``stages`` is to take part in a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # The decode node's blocks every stage writes its own layers' KV into.
    grant: KVGrant
    stages: tuple[StageRef, ...]
    index: int
    # The longest prefix the stages before hold (tokens): the group starts
    # from the least any stage holds.
    cap: int
    # Whether a stage may pull its layers' prefix from peers.
    peer_fetch: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.index < len(self.stages):
            raise ValueError(f"stage {self.index} of {len(self.stages)} is not one to open")

    @property
    def upstream(self) -> StageRef:
        return self.stages[self.index - 1]

    @property
    def me(self) -> StageRef:
        return self.stages[self.index]

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "request_id": self.request_id,
                "prompt_token_ids": self.prompt_token_ids,
                "sampling": encode_sampling(self.sampling),
                "grant": encode_grant(self.grant),
                "stages": [encode_stage(s) for s in self.stages],
                "index": self.index,
                "cap": self.cap,
                "peer_fetch": self.peer_fetch,
            }
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> StageOpen:
        """ValueError naming the field that is wrong."""
        stages = decode_stages(data.get("stages"))
        return cls(
            request_id=fields.text(data.get("request_id"), "request_id"),
            prompt_token_ids=decode_prompt(data.get("prompt_token_ids")),
            sampling=decode_sampling(data.get("sampling")),
            grant=decode_grant(data.get("grant")),
            stages=stages,
            index=fields.integer(data.get("index"), "index", 1, len(stages) - 1),
            cap=fields.integer(data.get("cap"), "cap", 0, _MAX_POS),
            peer_fetch=fields.flag(data.get("peer_fetch", True), "peer_fetch"),
        )

    def next(self, cap: int) -> StageOpen:
        """The call this stage makes to the one after it."""
        return StageOpen(
            self.request_id,
            self.prompt_token_ids,
            self.sampling,
            self.grant,
            self.stages,
            self.index + 1,
            cap,
            self.peer_fetch,
        )


@dataclass(frozen=True, slots=True)
class StageDone:
    """A stage's last line: the first sampled token (the last stage's) and the
    KV bytes it and the stages after it wrote into the decode node's blocks."""

    token: SampledToken
    num_bytes: int


def encode_opened(start: int, act: ActGrant) -> bytes:
    return orjson.dumps({"start": start, "act": encode_act(act)}) + b"\n"


def encode_done(done: StageDone) -> bytes:
    lp = done.token.logprob
    token = [done.token.token_id, encode_logprob(lp) if lp else None]
    return orjson.dumps({"token": token, "bytes": done.num_bytes}) + b"\n"


def encode_failed(why: str) -> bytes:
    return orjson.dumps({"error": why[:1000]}) + b"\n"


def decode_opened(line: bytes) -> tuple[int, ActGrant]:
    d = _line(line, "a stage's first line")
    return fields.integer(d.get("start"), "start", 0, _MAX_POS), decode_act(d.get("act"))


def decode_done(line: bytes) -> StageDone:
    d = _line(line, "a stage's last line")
    token = d.get("token")
    if not isinstance(token, list) or len(token) != 2:
        raise fields.refuse("token", "[token_id, logprob or null]", token)
    token_id, lp = token
    return StageDone(
        SampledToken(
            fields.integer(token_id, "token[0]"),
            None if lp is None else decode_logprob(lp, "token[1]"),
        ),
        fields.integer(d.get("bytes", 0), "bytes"),
    )


def _line(line: bytes, what: str) -> dict[str, Any]:
    d = fields.loads(line, what)
    error = d.get("error")
    if error is not None:
        raise StageError(str(error)[:1000])
    return d


@dataclass(frozen=True, slots=True)
class ChunkBody:
    """Positions [start, end) of ``request_id`` (the receiving stage's id) are in
    its rows: the ``seq``-th chunk of the request's input."""

    request_id: str
    seq: int
    start: int
    end: int

    def encode(self) -> bytes:
        return orjson.dumps(
            {"request_id": self.request_id, "seq": self.seq, "start": self.start, "end": self.end}
        )

    @classmethod
    def decode(cls, data: dict[str, Any]) -> ChunkBody:
        start = fields.integer(data.get("start"), "start", 0, _MAX_POS)
        return cls(
            request_id=fields.text(data.get("request_id"), "request_id"),
            seq=fields.integer(data.get("seq"), "seq", 0, _MAX_POS),
            start=start,
            end=fields.integer(data.get("end"), "end", start + 1, _MAX_POS),
        )


class StageBusy(StageError):
    """A stage had no room for the request (rows or blocks); nothing ran."""


class OpenedStage:
    """The answer of a stage that took part in a request: its first line, read
    by ``open``, and its last, read by ``done``. ``close`` aborts it (and the
    stages after it)."""

    def __init__(
        self,
        ref: StageRef,
        resp: aiohttp.ClientResponse,
        watch: MemberWatch | None,
        start: int,
        act: ActGrant,
    ) -> None:
        self.ref = ref
        self._resp: aiohttp.ClientResponse | None = resp
        self._watch = watch
        self.start = start
        self.act = act

    async def done(self) -> StageDone:
        """The stage's last line; StageError when it failed or went away."""
        resp = self._resp
        if resp is None:
            raise StageError(f"{self.ref.node_id}: the call was closed")
        line = await _readline(self.ref, resp, self._watch)
        try:
            return decode_done(line)
        except ValueError as exc:
            raise StageError(f"{self.ref.node_id} sent garbage: {exc}") from None

    def close(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            # Closing the connection cancels the handler there: it aborts
            # its part and closes its own call to the next stage.
            resp.close()


async def _readline(
    ref: StageRef, resp: aiohttp.ClientResponse, watch: MemberWatch | None
) -> bytes:
    try:
        read = resp.content.readline()
        line = await (watch.race(ref.node_id, read) if watch is not None else read)
    except MemberLost as exc:
        raise StageError(f"cut over: {exc}") from None
    except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
        raise StageError(f"{ref.node_id}: {exc!r}") from None
    if not line:
        raise StageError(f"{ref.node_id} closed the call before its answer")
    return line


class StageClient:
    """A stage's calls to the next one.

    ``targets(node_id)``: what a call to that node is signed for (its
    generation in this node's view), None when it is not in the view.
    """

    def __init__(
        self,
        *,
        key: bytes,
        session: Callable[[], aiohttp.ClientSession],
        targets: Callable[[str], Target | None],
        watch: MemberWatch | None = None,
    ) -> None:
        self._key = key
        self._session = session
        self._targets = targets
        self._watch = watch

    def _signed(self, node_id: str, path: str, raw: bytes) -> dict[str, str]:
        target = self._targets(node_id)
        if target is None:
            raise StageError(
                f"{node_id} is not in this node's cluster view; a call to it cannot be signed"
            )
        return {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", path, raw, target=target),
        }

    async def open(self, body: StageOpen) -> OpenedStage:
        """The next stage took part: its first line read. StageBusy when it had
        no room, StageError when it refused, failed or cannot be reached."""
        ref = body.me
        raw = body.encode()
        headers = self._signed(ref.node_id, PIPELINE_OPEN_PATH, raw)
        post = self._session().post(
            ref.url.rstrip("/") + PIPELINE_OPEN_PATH,
            data=raw,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )
        try:
            resp = await (self._watch.race(ref.node_id, post) if self._watch else post)
        except MemberLost as exc:
            raise StageError(f"cut over: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise StageError(f"{ref.node_id}: {exc!r}") from None
        try:
            if resp.status != 200:
                err = ErrorAnswer.decode(await resp.read())
                kind = (
                    StageBusy if resp.status == 409 and err.code == "prefill_busy" else StageError
                )
                raise kind(f"{ref.node_id} answered {resp.status}: {err.message}")
            line = await _readline(ref, resp, self._watch)
            try:
                start, act = decode_opened(line)
            except ValueError as exc:
                raise StageError(f"{ref.node_id} sent garbage: {exc}") from None
        except BaseException:
            resp.close()
            raise
        return OpenedStage(ref, resp, self._watch, start, act)

    async def notify(self, grant: ActGrant, seq: int, start: int, end: int) -> None:
        """A ``ChunkNotice``: tell the stage ``grant`` belongs to that
        positions [start, end) are in its rows; StageError when refused."""
        raw = ChunkBody(grant.request_id, seq, start, end).encode()
        headers = self._signed(grant.node_id, PIPELINE_CHUNK_PATH, raw)
        try:
            async with self._session().post(
                grant.url.rstrip("/") + PIPELINE_CHUNK_PATH,
                data=raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=30.0, sock_connect=5.0),
            ) as resp:
                payload = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise StageError(f"{grant.node_id}: {exc!r}") from None
        if resp.status != 204:
            err = ErrorAnswer.decode(payload)
            raise StageError(f"{grant.node_id} refused chunk {seq}: {err.message}")
