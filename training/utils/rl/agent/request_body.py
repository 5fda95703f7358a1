"""Request bodies off the event loop: read within a size limit, decoded and rendered in worker threads.

The event loop only moves bytes. Everything whose cost grows with the body runs in threads the
shim owns (`RequestWorkers`), each wait bounded by `request_timeout_s`. Every route that takes a
body (a model call, `count_tokens`) goes the same way:

1. take the body's share of `max_body_bytes_in_flight` (`BodyBudget`), which it holds until the
   request is answered, so the bodies held across all requests are bounded; then read the body
   within `client_timeout_s`, refusing one over `max_body_bytes` with a 413 (from
   Content-Length, before reading, when the client sends it); then count its JSON objects and
   arrays from above (its braces and brackets, text included) and refuse one over
   `max_request_items` (413), and take what parsing it will cost (`request_cost`) from
   `max_request_memory_in_flight`, process-wide and from the session's half of it, held until the
   request is answered: what a request costs grows with its items, not its bytes, and 240,000
   one-letter text blocks fit in 8 MB. A large request's memory is handed back to the system
   when it is answered (`memory.give_back_memory`);
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
   padding), which is what makes a concurrent call fail ("Already borrowed"). Text the floor of
   step 3 leaves out (assistant messages, tool schemas) could still make the prompt too long to
   fit: `count_tokens` always, and a model call whenever its assistant text could overflow, render
   the prompt as text and refuse it by its length before tokenizing it.

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
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from training.utils.config.rl import AgentShimConfig
from training.utils.deploy.connections import BodyTooLargeError, read_body
from training.utils.rl.agent import chat_request
from training.utils.rl.agent.chat_request import ChatRequest, ContextOverflowError, WireError, refuse_unseen
from training.utils.runtime.memory import give_back_memory

if TYPE_CHECKING:
    from training.utils.rl.agent.chat_format import ChatFormat
    from training.utils.rl.agent.session import PreparedTurn, ShimSession

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

MAX_JSON_VALUES = 1_000_000
"""The most JSON values a body may hold (a 413 beyond it), counted from above before parsing: a parsed value takes
tens of bytes however short its text, so a body of millions of tiny values (`[{},{},...]`) would cost many times
its size in memory and time. An agent's requests hold thousands; commas in their text count too, and still fit."""

BODIES_IN_FLIGHT = 8
"""`max_body_bytes_in_flight`, unset, is this many bodies of the largest size: room for every parse thread's body
and as many more waiting, while many agents' ordinary bodies (far below the limit) never wait."""

ITEM_BYTES = 2048
"""What one JSON object or array of a request costs once parsed, decoded into a `ChatRequest` and rendered (its dict,
its fields' strings, their copies), from above: the 240,000-block body measured at under 1 KiB an item."""

BODY_COPIES = 4
"""Copies of a body's bytes a request holds at its most (the raw bytes, the decoded text, the parsed strings, the
rendered prompt)."""

GIVE_BACK_FROM_BYTES = 32 * 2**20
"""A request estimated to cost this much or more hands the freed memory back to the system once it is answered."""

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


def body_limit(cfg: AgentShimConfig, context_tokens: int | None, token_bytes: int) -> int:
    """`cfg.max_body_bytes`, or unset, the most bytes a prompt that fits `context_tokens` can take as JSON (each
    of its tokens `token_bytes` long, every byte escaped), at least `BODY_FLOOR_BYTES`."""
    if cfg.max_body_bytes is not None:
        return cfg.max_body_bytes
    return max(BODY_FLOOR_BYTES, (context_tokens or 0) * token_bytes * JSON_ESCAPE_BYTES)


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
    """The body as JSON (a WireError 400 otherwise: not JSON, NaN or Infinity, too deep, a lone surrogate; 413
    past `MAX_JSON_VALUES`); empties `raw` once decoded."""
    values = 1 + sum(raw.count(mark) for mark in (b",", b"[", b"{"))  # every value but the first follows one
    if values > MAX_JSON_VALUES:
        raw.clear()
        raise WireError(f"the request body holds up to {values} JSON values (its commas, brackets and braces), "
                        f"over the limit of {MAX_JSON_VALUES}", status=413)
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
        raise WireError(f"the request body nests deeper than {chat_request.MAX_DEPTH} levels") from None
    except ValueError as e:
        raise WireError(f"the request body is not valid JSON: {e}") from None
    del text
    chat_request.plain_json(body)
    return body


def parse_turn(raw: bytearray, parse: Callable[[Any], ChatRequest], token_bytes: int,
               context_tokens: int | None, unseen: str = "placeholder") -> ChatRequest:
    """The body decoded by `parse` (a wire's `TurnCodec.parse`); an `EstimatedOverflowError` when its text alone
    cannot fit `context_tokens`, and with `unseen="refuse"` a WireError 400 naming content the model could not
    see (`agent_shim.unseen_content`: the agent must not believe the model read a file it never saw)."""
    chat = parse(parse_json(raw))
    if context_tokens:
        size, floor = text_token_floor(chat, token_bytes)
        _refuse_past_context("prompt's text", size, floor, token_bytes, context_tokens)
    if unseen == "refuse" and chat.unseen:
        refuse_unseen(chat.unseen)
    return chat


def count_prompt_tokens(chat_format: ChatFormat, chat: ChatRequest, token_bytes: int,
                        context_tokens: int | None) -> int:
    """`chat_format.count_tokens(chat)`, but a rendered prompt whose length alone cannot fit `context_tokens` is an
    `EstimatedOverflowError` before it is tokenized (tokenizing costs many times the text's size in memory)."""
    text = _rendered_within_context(chat_format, chat, token_bytes, context_tokens)
    return len(chat_format.tokenizer.encode(text, add_special_tokens=False))


def prepare_turn(session: ShimSession, chat: ChatRequest, token_bytes: int, context_tokens: int | None,
                 replay_route: str | None = None) -> PreparedTurn:
    """`session.prepare(chat, replay_route=replay_route)`, refusing first (`EstimatedOverflowError`) a prompt that
    cannot fit `context_tokens` because of its assistant messages, which the text floor of step 3 leaves out: when
    their text could overflow the context, the rendered prompt's length is checked before anything is tokenized."""
    if context_tokens:
        assistant = sum(_utf8_length(m.get("content") or "") for m in chat.messages if m.get("role") == "assistant")
        if text_token_floor(chat, token_bytes)[1] + -(-assistant // token_bytes) >= context_tokens:
            _rendered_within_context(session.chat_format, chat, token_bytes, context_tokens)
    return session.prepare(chat, replay_route=replay_route)


def _rendered_within_context(chat_format: ChatFormat, chat: ChatRequest, token_bytes: int,
                             context_tokens: int | None) -> str:
    """The prompt rendered as text; an `EstimatedOverflowError` when its length alone cannot fit `context_tokens`."""
    text = chat_format.prompt_text(chat)
    if context_tokens:
        size = _utf8_length(text)
        _refuse_past_context("rendered prompt", size, -(-size // token_bytes), token_bytes, context_tokens)
    return text


def _refuse_past_context(what: str, size: int, floor: int, token_bytes: int, context_tokens: int) -> None:
    if floor >= context_tokens:
        raise EstimatedOverflowError(
            f"the {what} is {size} bytes, so at least {floor} tokens (no token covers more than "
            f"{token_bytes} bytes), which leaves no room to generate within the context limit of "
            f"{context_tokens} tokens (deployment.max_context_tokens); shorten or compact the conversation",
            floor,
            context_tokens,
        )


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


class BodyBudget:
    """Bytes of request bodies held at once, across requests: each request takes its share before its body is read
    and gives it back when it is answered. A share that does not fit waits, first come first served (a large body
    is never overtaken for good), so no request holds part of its share while waiting for the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    async def take(self, size: int) -> None:
        """Wait until `size` more bytes fit, then hold them; give them back with `give`."""
        if not self._waiting and self.held + size <= self.limit:
            self.held += size
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((size, granted))
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.give(size)  # granted just as the wait gave up
            else:
                if (size, granted) in self._waiting:
                    self._waiting.remove((size, granted))
                self._grant()  # it may have been the head that held the others back
            raise

    def give(self, size: int) -> None:
        self.held -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.held + self._waiting[0][0] <= self.limit:
            size, granted = self._waiting.popleft()
            if not granted.done():  # else its wait was cancelled, and it is leaving
                self.held += size
                granted.set_result(None)


def request_items(raw: bytearray) -> int:
    """JSON objects and arrays the body can hold: its braces and brackets (those inside strings too), counted at
    C speed without parsing, a slice at a time with the GIL handed over between slices (the loop keeps turning)."""
    handover = _GilHandover()
    items = 0
    for start in range(0, len(raw), _DECODE_SLICE):
        items += raw.count(b"{", start, start + _DECODE_SLICE) + raw.count(b"[", start, start + _DECODE_SLICE)
        handover.check()
    return items


def request_cost(size: int, items: int) -> int:
    """Bytes a request of `size` body bytes and `items` objects and arrays may take in memory while it is served."""
    return BODY_COPIES * size + ITEM_BYTES * items


class RequestWorkers:
    """The threads a shim's app parses and renders in, and the body and context limits they enforce.

    Built with the app (`server.AgentShim`) and shut down with it (`close`, its cleanup).
    """

    def __init__(self, tokenizer, cfg: AgentShimConfig, context_tokens: int | None):
        self.timeout = cfg.request_timeout_s
        self.client_timeout = cfg.client_timeout_s
        self.context_tokens = context_tokens
        """The run's context limit (prompt + reply); None when the deployment does not say."""
        self.token_bytes = longest_token_bytes(tokenizer)
        self.max_body_bytes = body_limit(cfg, context_tokens, self.token_bytes)
        """Also the app's `client_max_size`."""
        self.budget = BodyBudget(max(cfg.max_body_bytes_in_flight or BODIES_IN_FLIGHT * self.max_body_bytes,
                                     self.max_body_bytes))
        """`max_body_bytes_in_flight` (never below one body of the largest size)."""
        self.max_items = cfg.max_request_items
        self.work = BodyBudget(cfg.max_request_memory_in_flight)
        """What parsed requests may cost at once, process-wide (`max_request_memory_in_flight`)."""
        self._session_work: dict[str, BodyBudget] = {}
        """Each session's half of it, while it has a request in flight."""
        self._limit_origin = "" if cfg.max_body_bytes is not None else (
            f", unset: derived from the context of {self.context_tokens} tokens" if self.context_tokens
            else ", unset and no context length known")
        self._parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="shim-parse")
        self._renderers = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="shim-render")

    @contextlib.asynccontextmanager
    async def body(self, request: web.Request, session_key: str) -> AsyncIterator[bytearray]:
        """The raw body, its share of the budget held until the block ends. A WireError 413 past `max_body_bytes`
        or `max_items`, 408 when it has not all arrived within `client_timeout_s`, 503 when the bodies in flight
        leave it no room within `client_timeout_s`; then `cost`'s hold on what parsing it may take."""
        size = request.content_length
        if size is not None and size > self.max_body_bytes:
            raise self._too_large(f"is {size} bytes")
        share = self.max_body_bytes if size is None else size
        try:
            async with asyncio.timeout(self.client_timeout):
                await self.budget.take(share)
        except TimeoutError:
            raise WireError(f"the shim holds {self.budget.held} bytes of request bodies and found no room for this "
                            f"one's {share} within {self.client_timeout:g}s (agent_shim.max_body_bytes_in_flight="
                            f"{self.budget.limit}); retry", status=503) from None
        try:
            try:
                raw = await read_body(request, self.max_body_bytes, self.client_timeout)
            except BodyTooLargeError:
                raise self._too_large(f"exceeds {self.max_body_bytes} bytes") from None
            except TimeoutError:
                raise WireError(f"the request body did not arrive within {self.client_timeout:g}s "
                                "(agent_shim.client_timeout_s)", status=408) from None
            async with self._cost(raw, session_key):
                yield raw
        finally:
            self.budget.give(share)

    @contextlib.asynccontextmanager
    async def _cost(self, raw: bytearray, session_key: str) -> AsyncIterator[None]:
        """Hold what serving `raw` may cost, from the process's budget and the session's half; refuse it first when
        it holds too many items or could never fit."""
        items = await asyncio.get_running_loop().run_in_executor(self._parsers, request_items, raw)
        if items > self.max_items:
            raw.clear()
            raise WireError(f"the request holds up to {items} JSON objects and arrays (messages, content blocks, "
                            f"tools; its braces and brackets), over the limit of {self.max_items} "
                            "(agent_shim.max_request_items)", status=413)
        cost = request_cost(len(raw), items)
        session_budget = self._session_work.setdefault(session_key, BodyBudget(self.work.limit // 2))
        if cost > session_budget.limit:
            raw.clear()
            raise WireError(f"serving the request could take {cost} bytes, over one session's share of "
                            f"{session_budget.limit} (agent_shim.max_request_memory_in_flight / 2)", status=413)
        taken = []
        try:
            async with asyncio.timeout(self.client_timeout):
                for budget in (session_budget, self.work):
                    await budget.take(cost)
                    taken.append(budget)
        except TimeoutError:
            for budget in taken:
                budget.give(cost)
            raw.clear()
            raise WireError(f"requests in flight hold {self.work.held} bytes of the shim's memory budget and left "
                            f"no room for this one's {cost} within {self.client_timeout:g}s "
                            f"(agent_shim.max_request_memory_in_flight={self.work.limit}); retry", status=503) from None
        try:
            yield
        finally:
            for budget in taken:
                budget.give(cost)
            if not session_budget.held and not session_budget._waiting:
                self._session_work.pop(session_key, None)
            if cost >= GIVE_BACK_FROM_BYTES:
                await asyncio.get_running_loop().run_in_executor(self._parsers, give_back_memory)

    async def count_tokens(self, chat_format: ChatFormat, chat: ChatRequest) -> int:
        """`count_prompt_tokens` in a render thread."""
        return await self._run(self._renderers, "counting the prompt's tokens", count_prompt_tokens, chat_format,
                               chat, self.token_bytes, self.context_tokens)

    async def parse_turn(self, raw: bytearray, parse: Callable[[Any], ChatRequest],
                         unseen: str = "placeholder") -> ChatRequest:
        """`parse_turn` of the body: decoded by `parse`, and refused when its text cannot fit the context (or, with
        `unseen="refuse"`, when it holds content the model cannot see)."""
        return await self._run(self._parsers, "parsing the request body", parse_turn, raw, parse, self.token_bytes,
                               self.context_tokens, unseen)

    async def prepare(self, session: ShimSession, chat: ChatRequest, replay_route: str | None = None) -> PreparedTurn:
        """`prepare_turn` in a render thread; call it in the session's queue turn."""
        return await self._run(self._renderers, "rendering the prompt", prepare_turn, session, chat, self.token_bytes,
                               self.context_tokens, replay_route)

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
