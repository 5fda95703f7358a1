"""The embedded inference engine: continuous batching on its own thread, awaited from asyncio.

One thread owns the model: it admits queued requests (`sequences.py`) into the running batch
(prefilling only what the prefix cache does not hold, `prefix_cache.py`; which requests and in how
many forwards: `admission.py`), runs one decode step for all rows (`decode.py`, sampling in
`next_token.py`), and applies weight updates between two steps (`engine_weights.py`). Why this is our
own loop and not transformers' `ContinuousBatchingManager`, how the loop works, and its
thread-safety rules: docs/engine-decode-loop.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.admission import PREFILL_SPLIT_COST_TOKENS, admit, split_by_length
from training.utils.deploy.completion import Completion
from training.utils.deploy.decode import KVBatch, usable_prefix_lengths
from training.utils.deploy.engine_memory import EngineMemory
from training.utils.deploy.engine_weights import WeightTargets, read_safetensors
from training.utils.deploy.graphs import decode_steps_for
from training.utils.deploy.next_token import SamplingParams_B, sample_next
from training.utils.deploy.prefix_cache import CachedKV, PrefixCache, prefix_cache_budget
from training.utils.deploy.sequences import SequenceGroup, SequenceState, make_group, sampling_params
from training.utils.errors import DeploymentError, RecoverableDeploymentError
from training.utils.models.cpu_attention import DECODE_NAME, use_cpu_attention
from training.utils.runtime import cpu_share
from training.utils.runtime.memory import kv_bytes_per_token

logger = logging.getLogger(__name__)

# An idle engine that receives a request waits while more keep arriving at most _BURST_GAP_S
# apart, for at most _BURST_MAX_WAIT_S (`Engine._await_burst`): paid only when starting from
# idle, and far below what a missed burst costs: a whole extra forward.
_BURST_GAP_S = 0.005
_BURST_MAX_WAIT_S = 0.02


@dataclass(eq=False)
class _WeightUpdate:
    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _resolve(fut: asyncio.Future, result) -> None:
    if fut.done():  # timed out or cancelled meanwhile
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


class Engine:
    """Continuous-batching generation over a private model copy, on a background thread.

    `model` must be a copy the engine owns (e.g. `copy.deepcopy(policy)`): the engine
    switches it to eval mode, turns off its gradients and overwrites its weights on sync.
    `weight_targets`: the only tensors a sync may write, by name, when the engine owns no more of
    `model` than those (a LoRA engine over the trainer's base, `lora.shared_base_copy`); default: all of it.
    `owned_tensors`: the tensors of `model` the engine holds itself, which its memory counts (default: its
    parameters and buffers; a LoRA engine over the trainer's base holds its adapters, buffers and whatever it cast).
    The thread starts here; call `close()` to stop it.
    """

    def __init__(self, model, tokenizer, cfg: DeploymentConfig, *, default_timeout_s: float = 300.0,
                 weight_targets: Mapping[str, torch.Tensor] | None = None,
                 owned_tensors: Iterable[torch.Tensor] | None = None, prefix_cache_bytes: int | None = None):
        self.model = model.eval()
        self.model.requires_grad_(False)
        use_cpu_attention(self.model, DECODE_NAME)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.default_timeout_s = float(default_timeout_s)
        text_config = model.config.get_text_config()
        self.max_context_tokens: int = int(cfg.max_context_tokens or text_config.max_position_embeddings)
        self.vocab_size: int = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids: frozenset[int] = frozenset(
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        self._weights = WeightTargets(self.model, weight_targets)
        self.shares_trainer_base = weight_targets is not None
        self._version = 0
        # Shared with callers, guarded by `_wake`'s lock.
        self._wake = threading.Condition()
        self._pending: deque[SequenceState] = deque()
        self._updates: deque[_WeightUpdate] = deque()
        self._closing = False
        # Owned by the engine thread.
        self._batch: KVBatch | None = None
        self._rows: list[SequenceState] = []
        self._params_B: SamplingParams_B | None = None
        self._split_cost_tokens = PREFILL_SPLIT_COST_TOKENS if self.model.device.type == "cpu" else None
        cache_bytes = prefix_cache_budget(cfg.prefix_cache_bytes if prefix_cache_bytes is None else prefix_cache_bytes,
                                          self.max_context_tokens, kv_bytes_per_token(model.config, self.model.dtype))
        self._prefix_cache = PrefixCache(cache_bytes) if cache_bytes else None
        owned = itertools.chain(self.model.parameters(), self.model.buffers()) if owned_tensors is None else \
            owned_tensors
        self._memory = EngineMemory(owned)
        # Cumulative; prompt_tokens = prefill_tokens + prefix_cache_hit_tokens (a request's prompt counts once).
        self.stats = {"requests": 0, "output_tokens": 0, "decode_steps": 0, "prefills": 0, "weight_updates": 0,
                      "prompt_tokens": 0, "prefill_tokens": 0, "prefix_cache_hit_tokens": 0,
                      "prefill_time_s": 0.0, "decode_time_s": 0.0}
        self._steps = decode_steps_for(self.model, cfg, self.stats)
        self._thread = threading.Thread(target=self._run, name="deploy-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """Weight version of the next sampled token."""
        return self._version

    @property
    def num_running(self) -> int:
        """Sequences being decoded now (a snapshot)."""
        return len(self._rows)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def memory_stats(self) -> dict[str, int]:
        """Bytes the engine holds (`EngineMemory.stats`): `weights`; `kv_cache_reserved`, `kv_cache_used` and
        `prefix_cache` at their most since the previous call. Callable from any thread."""
        return self._memory.stats(self._batch, self._prefix_cache)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        stop: str | Sequence[str] | None = None,
        timeout: float | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of `prompt_ids`; the tokenizer's EOS always stops.

        Raises `InvalidRequestError` (naming the field) for a bad request,
        `RecoverableDeploymentError` when `timeout` (default `default_timeout_s`) passes (the
        request is aborted and its slots freed), `DeploymentError` if the engine is closed
        or a decode step failed.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(result) -> None:  # runs on the engine thread
            try:
                loop.call_soon_threadsafe(_resolve, fut, result)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                pass

        group = make_group(
            prompt_ids, n, max_tokens, temperature, top_p, top_k, stop_token_ids, stop, seed,
            vocab_size=self.vocab_size, max_context_tokens=self.max_context_tokens, eos_token_ids=self.eos_token_ids,
        )
        group.deliver = deliver
        self._submit(group)
        timeout = self.default_timeout_s if timeout is None else float(timeout)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on Python 3.11 it can lose a cancel (gh-86296)
                return await fut
        except TimeoutError:
            self._cancel(group)
            raise RecoverableDeploymentError(
                f"generation timed out after timeout={timeout:g}s (prompt of {len(group.prompt_ids)} tokens, "
                f"n={group.n}, max_tokens={group.max_tokens}); the request was aborted and its slots freed"
            ) from None
        except asyncio.CancelledError:
            self._cancel(group)
            raise

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `named_tensors` into the engine's model between two decode steps, then set `version`.

        Blocks until applied (at most `cfg.weight_sync_timeout_s`). Names are the model's
        `state_dict()` keys; a subset is allowed, unknown names or wrong shapes raise
        `ValueError` before anything is copied. Call from any thread but the engine's.
        """
        if threading.current_thread() is self._thread:
            raise DeploymentError("update_weights was called from the engine thread; it would wait for itself")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"update_weights: version must be an int, got {version!r}")
        dst, src = self._weights.match(named_tensors)
        job = _WeightUpdate(dst, src, version)
        with self._wake:
            if self._closing or not self._thread.is_alive():
                raise DeploymentError("update_weights: the engine is closed")
            self._updates.append(job)
            self._wake.notify_all()
        timeout = self.cfg.weight_sync_timeout_s
        if not job.done.wait(timeout):
            with self._wake:
                withdrawn = job in self._updates
                if withdrawn:
                    self._updates.remove(job)
            if withdrawn:
                raise DeploymentError(
                    f"weight update to version {version} was not applied within weight_sync_timeout_s={timeout:g}s "
                    f"(inflight_on_sync={self.cfg.inflight_on_sync!r}: "
                    f"{len(self._rows)} requests still in flight); the engine keeps version {self._version}"
                )
            job.done.wait()  # the engine thread took the job just now: the copy is under way
        if job.error is not None:
            raise DeploymentError(f"weight update to version {version} failed: {job.error!r}") from job.error

    def load_weights_from_disk(self, path: str | Path, version: int | None = None, *, root: Path) -> int:
        """Read safetensors weights (a file, `model.safetensors`, or a sharded index) from inside `root` and apply
        them; a ValueError, with nothing applied, for a path outside `root` or a non-finite tensor.

        `version` defaults to the current version + 1. Returns the version applied.
        """
        tensors = read_safetensors(path, device=self.model.device, root=root)
        version = self._version + 1 if version is None else version
        self.update_weights(tensors, version)
        return version

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (joined with `timeout`); unfinished requests end with finish_reason "abort"."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.1fs (a decode step is still running)", timeout)

    # ------------------------------------------------------------------ request intake

    def _submit(self, group: SequenceGroup) -> None:
        with self._wake:
            if self._closing or not self._thread.is_alive():
                raise DeploymentError("the engine is closed")
            self._pending.extend(group.seqs)
            self.stats["requests"] += 1
            self._wake.notify_all()

    def _cancel(self, group: SequenceGroup) -> None:
        with self._wake:
            group.cancelled = True
            self._wake.notify_all()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        on_cpu = self.model.device.type == "cpu"
        full_threads = torch.get_num_threads()  # this thread's share when no trainer computes beside it
        try:
            while True:
                with self._wake:
                    while not self._closing and not self._has_work():
                        self._wake.wait(timeout=1.0)
                    if self._closing:
                        return
                    if not self._rows and not self._updates:
                        self._await_burst()
                    update = self._update_to_apply()
                    free = self.cfg.max_batch_requests - len(self._rows)
                    admitted = admit(self._pending, free) if not self._updates else []
                try:
                    if update is not None:
                        self._apply_update(update)
                    self._drop_cancelled_rows()
                    # On a CPU: half its threads while a trainer computes, and counted on the shared clock.
                    sharing = cpu_share.engine_step(full_threads) if on_cpu else contextlib.nullcontext()
                    with sharing, torch.inference_mode():
                        if admitted:
                            self._timed("prefill_time_s", self._prefill, admitted)
                        if self._rows:
                            self._timed("decode_time_s", self._decode)
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, the engine keeps serving
                    logger.exception("engine step failed; failing %d in-flight sequences", len(self._rows))
                    self._fail_rows(DeploymentError(f"engine decode step failed: {e!r}"), admitted)
        finally:
            self._shutdown()

    def _await_burst(self) -> None:
        """Starting from idle, wait while requests keep arriving, so a burst shares one prefill.

        Requests of a burst (`asyncio.gather` of many calls, or many HTTP requests) reach the
        engine one by one; admitting only the first costs a whole extra forward for it (a
        prefill, then a decode step of one row) before the rest join. Holds `_wake`.
        """
        deadline = time.monotonic() + _BURST_MAX_WAIT_S
        seen = len(self._pending)
        while not self._closing and seen < self.cfg.max_batch_requests:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(_BURST_GAP_S, remaining))
            if len(self._pending) == seen:
                return  # nothing new within the gap: the burst is over
            seen = len(self._pending)

    def _has_work(self) -> bool:
        return bool(self._rows or self._updates or self._pending)

    def _update_to_apply(self) -> _WeightUpdate | None:
        if not self._updates:
            return None
        if self.cfg.inflight_on_sync == "finish_old" and self._rows:
            return None  # wait for in-flight rows; admissions are held meanwhile
        return self._updates.popleft()

    def _timed(self, key: str, step, *args) -> None:
        start = time.perf_counter()
        step(*args)  # a step ends with sampling's host sync, so on a GPU this is its device time too
        self.stats[key] += time.perf_counter() - start

    def _apply_update(self, job: _WeightUpdate) -> None:
        if self._prefix_cache is not None:
            self._prefix_cache.clear()  # tokens sampled from now on must not attend to the old weights' keys
        try:
            with torch.no_grad():
                torch._foreach_copy_(job.dst, job.src)
            if job.dst[0].is_cuda:
                # The version moves once the copy is done, and a failed copy is reported to the caller.
                torch.cuda.synchronize(job.dst[0].device)
            self._version = job.version
            self.stats["weight_updates"] += 1
        except Exception as e:  # noqa: BLE001 - reported to the caller of update_weights
            job.error = e
        finally:
            job.done.set()

    def _prefill(self, admitted: list[SequenceState]) -> None:
        """Prefill the prompts of the `admitted` sequences' requests, each distinct prompt once; start decoding them.

        With the prefix cache, requests with equal prompts share one prefill row, and a prompt
        starting with cached tokens feeds only the rest (`prefix_cache.py`).
        """
        by_prompt: dict[tuple[int, ...] | int, list[SequenceGroup]] = {}  # a distinct prompt -> its requests
        for group in dict.fromkeys(seq.group for seq in admitted):
            key = tuple(group.prompt_ids) if self._prefix_cache is not None else id(group)
            by_prompt.setdefault(key, []).append(group)
        groups_U = list(by_prompt.values())
        matches_U = [self._prefix_cache.match(gs[0].prompt_ids) if self._prefix_cache is not None else (None, 0)
                     for gs in groups_U]
        # Longest remainders first: the later, shorter forwards then fit the batch's width in place.
        new_U = [len(gs[0].prompt_ids) - m for gs, (_, m) in zip(groups_U, matches_U)]
        for chunk in split_by_length(new_U, self._split_cost_tokens):
            members = {g for i in chunk for g in groups_U[i]}
            self._prefill_chunk([groups_U[i] for i in chunk], [matches_U[i] for i in chunk],
                                [seq for seq in admitted if seq.group in members])

    def _prefill_chunk(
        self, groups_U: list[list[SequenceGroup]], matches_U: list[tuple[CachedKV | None, int]],
        admitted: list[SequenceState],
    ) -> None:
        """Prefill distinct prompts in one forward (`groups_U`: the requests of each, `matches_U`: its cached
        prefix); append `admitted` (their sequences) to the batch."""
        prompts = [gs[0].prompt_ids for gs in groups_U]
        used = usable_prefix_lengths([len(p) for p in prompts], [m for _, m in matches_U])
        cached = [kv.head(u) if u else None for (kv, _), u in zip(matches_U, used)]
        new, logits_P = KVBatch.prefill(self.model, prompts, cached)
        self.stats["prefills"] += 1
        self._count_prompt_tokens(prompts, groups_U, used)
        if self._prefix_cache is not None:
            for i, prompt in enumerate(prompts):
                self._prefix_cache.add(prompt, partial(new.row_kv, i, len(prompt)))
        index = {id(g): i for i, gs in enumerate(groups_U) for g in gs}
        rows = [index[id(seq.group)] for seq in admitted]
        if rows != list(range(len(prompts))):
            new = KVBatch.gather([(new, rows)], consume=True)  # n > 1 or equal prompts: one prefill, to each row
            logits_P = logits_P[torch.tensor(rows, device=logits_P.device)]
        params = sampling_params(admitted, logits_P.device)
        capacity = self.cfg.max_batch_requests
        if self._batch is not None:
            self._batch = self._batch.insert(new, capacity)
        else:
            self._batch = new.with_stable_buffers(capacity) if self._steps is not None else new
        self._rows = self._rows + admitted
        self._params_B = None
        self._record(admitted, logits_P, params, first_row=len(self._rows) - len(admitted))

    def _count_prompt_tokens(self, prompts: list[list[int]], groups_U: list[list[SequenceGroup]], used: list[int]):
        """Prompt tokens by where their keys/values came from: this forward, the cache, or an equal prompt's row."""
        self.stats["prompt_tokens"] += sum(len(p) * len(gs) for p, gs in zip(prompts, groups_U))
        self.stats["prefill_tokens"] += sum(len(p) - u for p, u in zip(prompts, used))
        self.stats["prefix_cache_hit_tokens"] += sum(u + len(p) * (len(gs) - 1)
                                                     for p, gs, u in zip(prompts, groups_U, used))

    def _decode(self) -> None:
        self._memory.note(self._batch)  # before finished rows leave: the most the batch holds this step
        tokens = torch.tensor([seq.output_ids[-1] for seq in self._rows], device=self.model.device)
        if self._steps is not None:
            logits = self._steps.step(self._batch, tokens)
        else:
            logits = self._batch.decode(self.model, tokens)
        self.stats["decode_steps"] += 1
        if self._params_B is None:
            self._params_B = sampling_params(self._rows, logits.device)
        self._record(self._rows, logits, self._params_B, first_row=0)

    def _record(self, seqs: list[SequenceState], logits, params: SamplingParams_B, first_row: int) -> None:
        """Sample one token for each of `seqs` (rows first_row.. of the batch); retire finished rows."""
        tokens, logprobs = sample_next(logits, params)
        version = self._version
        finished: list[int] = []
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = seq.finish_reason_after(token, self.tokenizer)
            if reason is not None:
                seq.finish_reason = reason
                finished.append(first_row + i)
        self.stats["output_tokens"] += len(seqs)
        if finished:
            self._retire(finished)

    def _retire(self, rows: list[int]) -> None:
        done = [self._rows[i] for i in rows]
        if self._prefix_cache is not None:
            self._keep_prefixes(rows)
        if len(rows) == len(self._rows) and self._steps is None:
            self._rows, self._batch = [], None
        else:
            order = self._batch.remove(rows)  # the batch moves rows; mirror it in `_rows`
            self._rows = [self._rows[i] for i in order]
            self._batch = self._batch.maybe_trim(self.cfg.max_batch_requests)
        self._params_B = None
        for seq in done:
            self._seq_done(seq)

    def _keep_prefixes(self, rows: list[int]) -> None:
        """Cache the keys/values of finished rows computed on the current weights (for a next turn)."""
        for i in rows:
            seq = self._rows[i]
            if seq.finish_reason == "abort" or seq.versions[0] != self._version:
                continue  # cancelled, or begun before a weight update: its first keys are the old weights'
            tokens = seq.group.prompt_ids + seq.output_ids[:-1]  # the last sampled token was never fed
            self._prefix_cache.add(tokens, partial(self._batch.row_kv, i, len(tokens)))

    def _seq_done(self, seq: SequenceState) -> None:
        group = seq.group
        group.remaining -= 1
        if group.remaining == 0 and not group.cancelled:
            group.deliver([s.completion(self.tokenizer) for s in group.seqs])

    def _drop_cancelled_rows(self) -> None:
        rows = [i for i, seq in enumerate(self._rows) if seq.group.cancelled]
        if rows:
            for i in rows:
                self._rows[i].finish_reason = "abort"
            with torch.inference_mode():
                self._retire(rows)

    def _fail_rows(self, error: BaseException, admitted: list[SequenceState]) -> None:
        """Fail every request with a row in the batch or admitted this iteration; reset the batch."""
        groups = {id(seq.group): seq.group for seq in self._rows + admitted}
        self._rows, self._batch, self._params_B = [], None, None
        for group in groups.values():
            group.cancelled = True
            group.deliver(error)
        with self._wake:
            self._pending = deque(s for s in self._pending if id(s.group) not in groups)

    def _shutdown(self) -> None:
        """Runs on the engine thread as it exits: end every request and weight update still waiting."""
        with self._wake:
            self._closing = True
            pending, self._pending = list(self._pending), deque()
            updates, self._updates = list(self._updates), deque()
        for seq in self._rows + pending:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                self._seq_done(seq)
        self._rows, self._batch = [], None
        for job in updates:
            job.error = DeploymentError("the engine closed before the weight update was applied")
            job.done.set()
