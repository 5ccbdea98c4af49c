"""Tokenizers: ``tokenizer.json`` through ``tokenizers``, and a byte tokenizer.

Both implement ``Tokenizer``. Chat templates are Jinja2 rendered the way
transformers renders them (sandboxed, ``raise_exception``, ``bos_token`` and
``eos_token`` in scope). A rendered chat prompt already holds its special
tokens, so encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str: ...

    def token_str(self, token_id: int) -> str: ...


# ---------------------------------------------------------------------------
# Chat templates


class _TemplateError(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    __slots__ = ("_template", "_vars", "source")

    def __init__(self, source: str, special_vars: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self._vars = dict(special_vars)
        self.source = source

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        normalized = normalize_messages(messages)
        try:
            return self._template.render(
                messages=normalized, add_generation_prompt=add_generation_prompt, **self._vars
            )
        except _TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from None


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list; text parts are joined into one string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts: list[str] = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}"
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        msg = dict(m)
        msg["content"] = text
        out.append(msg)
    return out


# ---------------------------------------------------------------------------
# Byte tokenizer (builtin model)

BYTE_SPECIAL_TOKENS = (
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<pad>",
)

BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class ByteTokenizer:
    """Ids 0..255 are bytes; then ``BYTE_SPECIAL_TOKENS``; the rest of the vocab is unused."""

    def __init__(self, vocab_size: int = 384) -> None:
        if vocab_size < 256 + len(BYTE_SPECIAL_TOKENS):
            raise ValueError(f"byte tokenizer needs vocab_size >= 263, got {vocab_size}")
        self.vocab_size = vocab_size
        self._special_ids = {s: 256 + i for i, s in enumerate(BYTE_SPECIAL_TOKENS)}
        self._special_strs = {i: s for s, i in self._special_ids.items()}
        self.bos_token_id: int | None = self._special_ids["<s>"]
        self.eos_token_id = self._special_ids["</s>"]
        self.eos_token_ids: tuple[int, ...] = (self.eos_token_id,)
        self.pad_token_id = self._special_ids["<pad>"]
        self._split = re.compile("(" + "|".join(re.escape(s) for s in BYTE_SPECIAL_TOKENS) + ")")
        self._template = ChatTemplate(BYTE_CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})

    @property
    def chat_template(self) -> str:
        return self._template.source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = [self._special_ids["<s>"]] if add_special_tokens else []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._special_ids.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for t in ids:
            if 0 <= t < 256:
                buf.append(t)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if not skip_special_tokens and t in self._special_strs:
                out.append(self._special_strs[t])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_str(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            b = bytes([token_id])
            return b.decode("utf-8") if token_id < 128 else f"\\x{token_id:02x}"
        return self._special_strs.get(token_id, f"<unused_{token_id}>")

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        return self._template.render(messages, add_generation_prompt)


# ---------------------------------------------------------------------------
# Hugging Face tokenizer.json


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as "str" or {"content": "str", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer:
    """A ``tokenizers`` tokenizer plus the special tokens and chat template around it.

    Built from a Hugging Face model directory (``tokenizer.json`` +
    ``tokenizer_config.json``), or with ``from_parts`` from pieces read
    elsewhere (a GGUF file's vocabulary and metadata).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        from tokenizers import Tokenizer as _HFTok

        d = Path(model_dir)
        tok_path = d / "tokenizer.json"
        if not tok_path.is_file():
            raise ValueError(f"{d}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tok = _HFTok.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"{tok_path}: cannot load: {exc}") from None
        cfg_path = d / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text("utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{cfg_path}: not valid JSON: {exc}") from None
        # Added tokens declared only in tokenizer_config.json (older exports).
        for entry in (cfg.get("added_tokens_decoder") or {}).values():
            content = _token_content(entry)
            if content is not None and tok.token_to_id(content) is None:
                from tokenizers import AddedToken

                tok.add_special_tokens([AddedToken(content, special=True)])

        template = cfg.get("chat_template")
        if isinstance(template, list):
            # A list of named templates: use "default".
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text("utf-8")
        self._setup(
            tok,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            unk_token=_token_content(cfg.get("unk_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            add_bos=bool(cfg.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @classmethod
    def from_parts(
        cls,
        tok: Any,
        *,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> HFTokenizer:
        """Wrap an already built ``tokenizers.Tokenizer``."""
        self = cls.__new__(cls)
        self._setup(
            tok,
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            add_bos=add_bos,
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos_token_ids,
        )
        return self

    def _setup(
        self,
        tok: Any,
        *,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None,
        pad_token: str | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int],
    ) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = bos_token
        self.eos_token: str | None = eos_token
        self.unk_token: str | None = unk_token
        self.pad_token: str | None = pad_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        eos_ids: list[int] = []
        eos_id = tok.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        for t in extra_eos_token_ids:
            if t not in eos_ids:
                eos_ids.append(int(t))
        self.eos_token_ids = tuple(eos_ids)
        self._add_bos = add_bos
        self._template: ChatTemplate | None = None
        if chat_template is not None:
            special_vars: dict[str, str | None] = {
                "bos_token": bos_token,
                "eos_token": eos_token,
                "unk_token": unk_token,
                "pad_token": pad_token,
            }
            self._template = ChatTemplate(chat_template, special_vars)

    @property
    def chat_template(self) -> str | None:
        return self._template.source if self._template else None

    def save(self, model_dir: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``:
        ``HFTokenizer(model_dir)`` and transformers' fast tokenizer read them
        back as this tokenizer."""
        d = Path(model_dir)
        self._tok.save(str(d / "tokenizer.json"))
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k: v for k, v in specials.items() if v is not None},
            "add_bos_token": self._add_bos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # Some exports ask for BOS in tokenizer_config.json without a
        # post-processor that adds it.
        if (
            add_special_tokens
            and self._add_bos
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(messages, add_generation_prompt)


# ---------------------------------------------------------------------------
# Streaming detokenization


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text.

    Decodes a sliding window (``prefix_offset`` .. end) and emits what the
    window adds beyond its first part (``prefix_offset`` .. ``read_offset``):
    the window's start gives the decoder the context it needs for spaces and
    merges, and text ending in U+FFFD (an incomplete UTF-8 sequence, from
    byte-fallback or byte-level tokens) is held back until the next token
    completes it.
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_skip_special", "tokenizer")

    # Tokens of context before the unread ones; enough for any merge to settle.
    _WINDOW = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The prompt's tail is the first window's context: SentencePiece-style
        # tokenizers drop the leading space of the first word they decode, so
        # without it the completion " world" would stream as "world".
        self._ids: list[int] = list(prompt_ids[-self._WINDOW :]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that ``token_ids`` complete; may be empty."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset = max(self._prefix_offset, len(self._ids) - self._WINDOW)
        self._read_offset = len(self._ids)
        self._trim()
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, lo: int, hi: int) -> str:
        if lo >= hi:
            return ""
        return self.tokenizer.decode(self._ids[lo:hi], skip_special_tokens=self._skip_special)

    def _trim(self) -> None:
        # Keep memory bounded on long generations: ids before the window are done.
        if self._prefix_offset > 4096:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
