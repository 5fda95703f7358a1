"""Request bodies off the event loop: read within a size limit, decoded and rendered in worker threads.

The event loop only moves bytes. Everything whose cost grows with the body runs in threads the
shim owns (`RequestWorkers`), each wait bounded by `request_timeout_s`:

1. read the body, refusing one over `max_body_bytes` with a 413 (from Content-Length, before
   reading, when the client sends it);
2. turn its bytes into text, parse that as plain JSON and have the wire's codec decode it
   (`TurnCodec.parse`), in one of `PARSE_THREADS` threads; the raw bytes are freed once read as
   text and the parsed body once decoded, so at most two copies of a large body exist at any time;
3. refuse a prompt whose text alone cannot fit the context (`text_token_floor`) before anything
   is rendered: no token stands for more than `longest_token_bytes` of text, so text bytes over
   that length is a lower bound on its tokens;
4. render and tokenize the prompt (`ShimSession.prepare`, or `count_tokens`) in one of
   `RENDER_THREADS` threads, so one session's long render never holds up another's (each
   session renders one request at a time, in its queue turn). The tokenizer is shared with the
   loop (decoding replies), these threads and the deployment's thread: HF fast tokenizers may
   encode from several threads at once, and the shim never reconfigures one (truncation,
   padding), which is what makes a concurrent call fail ("Already borrowed").

A parse hands the GIL over every `_HANDOVER_EVERY_S` (`_GilHandover`): the body is decoded in
slices, and the C JSON parser calls a Python hook per object that releases the GIL once that
long has passed. Left to the interpreter, the loop's thread would wait a whole switch interval
(`sys.getswitchinterval()`) at every wake-up, and one C call (decoding a whole large body) would
hold the GIL for as long as it runs. One flat array of millions of scalars has no objects to
hook, so it can still hold the GIL for its whole parse.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from training.utils.config import AgentShimConfig
from training.utils.rl.agent import fields
from training.utils.rl.agent.chat_request import ChatRequest, ContextOverflowError, WireError

if TYPE_CHECKING:
    from training.utils.rl.agent.chat_format import ChatFormat
    from training.utils.rl.agent.session import PreparedTurn, ShimSession
    from training.utils.rl.agent.wire_format import TurnCodec

BODY_FLOOR_BYTES = 32 * 2**20
"""The derived body limit is never below the Anthropic Messages API's own (32 MB): a body the real API takes,
screenshots and other media that render as a short placeholder included, is never refused for its size."""

JSON_ESCAPE_BYTES = 6
"""The most body bytes one byte of text can take: JSON may spell any character as a six-byte `\\uXXXX`."""

NORMALIZER_SHRINK = 4
"""How many times fewer bytes a Unicode normalizer can leave (NFKC folds 4-byte mathematical letters to ASCII);
a tokenizer with a normalizer has its longest token counted this many times longer."""

PARSE_THREADS = 4
"""Bodies parsed at once: a few large ones can be in progress while small ones still find a free thread
(the GIL makes more threads no faster, only fairer)."""

RENDER_THREADS = 4
"""Prompts rendered and tokenized at once, for the same reason: a session rendering a huge prompt (or counting
one) leaves threads free for the others."""

_UTF8_CHUNK = 1 << 20
_DECODE_SLICE = 1 << 20
_HANDOVER_EVERY_S = 0.001


class EstimatedOverflowError(ContextOverflowError):
    """A prompt refused on its text's length alone: `prompt_tokens` is a lower bound, never counted exactly."""

    def note(self) -> str:
        """Appended to the wire's overflow message, which states `prompt_tokens` as if it were exact."""
        return f" (at least {self.prompt_tokens} tokens: a lower bound from the text's length, not tokenized)"


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token stands for: the longest decoded token or vocabulary piece (a piece is
    never shorter than the text it covers, even where decoding drops a leading space), added tokens included
    (a special token's text in a message is one token); times `NORMALIZER_SHRINK` behind a normalizer."""
    vocab = tokenizer.get_vocab()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch([[i] for i in vocab.values()], skip_special_tokens=False)
    else:
        texts = [tokenizer.convert_tokens_to_string([piece]) for piece in vocab]
    longest = max(max(len(piece), len(text.encode("utf-8", "surrogatepass"))) for piece, text in zip(vocab, texts))
    normalized = backend is None or backend.normalizer is not None
    return longest * (NORMALIZER_SHRINK if normalized else 1)


def body_limit(cfg: AgentShimConfig, token_bytes: int) -> int:
    """`cfg.max_body_bytes`, or unset, the most bytes a prompt that fits the context can take as JSON (each of
    its tokens `token_bytes` long, every byte escaped), at least `BODY_FLOOR_BYTES`."""
    if cfg.max_body_bytes is not None:
        return cfg.max_body_bytes
    return max(BODY_FLOOR_BYTES, (cfg.max_context_tokens or 0) * token_bytes * JSON_ESCAPE_BYTES)


def text_token_floor(chat: ChatRequest, token_bytes: int) -> tuple[int, int]:
    """(text bytes, a lower bound on the prompt's tokens) from the text every chat template renders whole: the
    system text and each user, tool and system message's content, stripped as a template's `trim` would.
    Assistant messages are left out: a template may drop their reasoning, and the session may restore them."""
    texts = [chat.system or ""] + [m.get("content") or "" for m in chat.messages if m.get("role") != "assistant"]
    size = sum(_utf8_length(text.strip()) for text in texts)
    return size, -(-size // token_bytes)


def _utf8_length(text: str) -> int:
    if text.isascii():
        return len(text)
    # Encoded in slices, so a huge non-ASCII text is never held twice (or four times) over.
    return sum(len(text[i:i + _UTF8_CHUNK].encode("utf-8", "surrogatepass"))
               for i in range(0, len(text), _UTF8_CHUNK))


def parse_json(raw: bytearray) -> Any:
    """The body as JSON (a WireError 400 otherwise: not JSON, NaN or Infinity, too deep, a lone surrogate);
    empties `raw` once decoded."""
    handover = _GilHandover()
    try:
        text = _decode(raw, handover)
    except UnicodeDecodeError as e:
        raise WireError(f"the request body is not valid JSON: {e}") from None
    finally:
        raw.clear()
    try:
        body = json.loads(text, parse_constant=_not_json, object_hook=handover.hook)
    except RecursionError:
        raise WireError(f"the request body nests deeper than {fields.MAX_DEPTH} levels") from None
    except ValueError as e:
        raise WireError(f"the request body is not valid JSON: {e}") from None
    del text
    fields.plain_json(body)
    return body


def parse_turn(raw: bytearray, codec: TurnCodec, token_bytes: int, context_tokens: int | None) -> ChatRequest:
    """The body decoded by `codec`; an `EstimatedOverflowError` when its text alone cannot fit `context_tokens`."""
    chat = codec.parse(parse_json(raw))
    if context_tokens:
        size, floor = text_token_floor(chat, token_bytes)
        if floor >= context_tokens:
            raise EstimatedOverflowError(
                f"the prompt's text is {size} bytes, so at least {floor} tokens (no token covers more than "
                f"{token_bytes} bytes), which leaves no room to generate within the context limit of "
                f"{context_tokens} tokens (agent_shim.max_context_tokens); shorten or compact the conversation",
                floor,
                context_tokens,
            )
    return chat


def _not_json(constant: str) -> None:
    # Python's json reads NaN and Infinity, which JSON does not have (and no reply could echo).
    raise ValueError(f"{constant} is not a JSON value")


def _decode(raw: bytearray, handover: _GilHandover) -> str:
    """`raw` as text (UTF-8, or the UTF-16/32 JSON allows), decoded a slice at a time; empties `raw` before
    joining the slices, so the body is never held three times over."""
    decoder = codecs.getincrementaldecoder(json.detect_encoding(raw))("surrogatepass")
    parts = []
    for start in range(0, len(raw), _DECODE_SLICE):
        parts.append(decoder.decode(raw[start:start + _DECODE_SLICE]))  # a copy: no view pins `raw`
        handover.check()
    parts.append(decoder.decode(b"", final=True))
    raw.clear()
    return "".join(parts)


class _GilHandover:
    """Releases the GIL for a moment once `_HANDOVER_EVERY_S` has passed since the last time, so a thread waiting
    for it (the event loop's) gets it at once rather than after the interpreter's switch interval."""

    def __init__(self):
        self._last = time.perf_counter()

    def check(self) -> None:
        now = time.perf_counter()
        if now - self._last > _HANDOVER_EVERY_S:
            time.sleep(0)  # releases the GIL; a waiting thread takes it
            self._last = time.perf_counter()

    def hook(self, obj: dict) -> dict:
        """`object_hook` for `json.loads`: the C parser calls it for every object it builds."""
        self.check()
        return obj


class RequestWorkers:
    """The threads a shim's app parses and renders in, and the body and context limits they enforce.

    Built with the app (`server.AgentShim`) and shut down with it (`close`, its cleanup).
    """

    def __init__(self, tokenizer, cfg: AgentShimConfig):
        self.timeout = cfg.request_timeout_s
        self.context_tokens = cfg.max_context_tokens
        self.token_bytes = longest_token_bytes(tokenizer)
        self.max_body_bytes = body_limit(cfg, self.token_bytes)
        """Also the app's `client_max_size`."""
        self._limit_origin = "" if cfg.max_body_bytes is not None else (
            f", unset: derived from the context of {self.context_tokens} tokens" if self.context_tokens
            else ", unset and no context length known")
        self._parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="shim-parse")
        self._renderers = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="shim-render")

    async def read(self, request: web.Request) -> bytearray:
        """The raw body; a WireError 413 past `max_body_bytes`, 408 when it does not arrive in time."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise self._too_large(f"is {request.content_length} bytes")
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                async for chunk in request.content.iter_any():
                    body += chunk
                    if len(body) > self.max_body_bytes:
                        raise self._too_large(f"exceeds {self.max_body_bytes} bytes")
        except TimeoutError:
            raise WireError(f"the request body did not arrive within {self.timeout:g}s", status=408) from None
        return body

    async def parse_request(self, raw: bytearray, parse: Callable[[Any], ChatRequest]) -> ChatRequest:
        """`parse` of the body, with no context check (`count_tokens` counts whatever it is sent)."""
        return await self._run(self._parsers, "parsing the request body", lambda: parse(parse_json(raw)))

    async def count_tokens(self, chat_format: ChatFormat, chat: ChatRequest) -> int:
        """`chat_format.count_tokens(chat)` in a render thread."""
        return await self._run(self._renderers, "counting the prompt's tokens", chat_format.count_tokens, chat)

    async def parse_turn(self, raw: bytearray, codec: TurnCodec) -> ChatRequest:
        """`parse_turn` of the body: decoded by the wire's `codec`, and refused when its text cannot fit the context."""
        return await self._run(self._parsers, "parsing the request body", parse_turn, raw, codec, self.token_bytes,
                               self.context_tokens)

    async def prepare(self, session: ShimSession, chat: ChatRequest) -> PreparedTurn:
        """`session.prepare(chat)` in a render thread; call it in the session's queue turn."""
        return await self._run(self._renderers, "rendering the prompt", session.prepare, chat)

    async def close(self, _app: web.Application | None = None) -> None:
        """Take no more work; a job already running finishes in its thread, its result unread."""
        self._parsers.shutdown(wait=False, cancel_futures=True)
        self._renderers.shutdown(wait=False, cancel_futures=True)

    async def _run(self, pool: ThreadPoolExecutor, what: str, job: Callable, *args: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                return await asyncio.get_running_loop().run_in_executor(pool, job, *args)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise WireError(f"{what} took longer than {self.timeout:g}s", status=503) from None

    def _too_large(self, size: str) -> WireError:
        return WireError(f"the request body {size}, over the limit of {self.max_body_bytes} bytes "
                         f"(agent_shim.max_body_bytes{self._limit_origin})", status=413)
