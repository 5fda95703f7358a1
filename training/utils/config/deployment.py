"""The inference side's configs: the sampling defaults, the deployment rollouts sample from, the agent shim."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from training.utils.config import cookbook as cookbook_config
from training.utils.config.base import FiniteFloat, StrictModel


class SamplingConfig(StrictModel):
    """Default sampling parameters handed to rollouts as `setup.sample_kwargs`."""

    max_tokens: int = Field(256, gt=0)
    """Maximum new tokens per completion."""
    temperature: FiniteFloat = Field(1.0, ge=0)
    """Sampling temperature; the trainer computes logprobs at the same temperature. 0 means greedy."""
    top_p: FiniteFloat = Field(1.0, gt=0, le=1)
    """Nucleus sampling; keep 1.0 for RL so the sampled distribution is the one the trainer scores."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables it (keep it off for RL for the same reason as top_p)."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings; the tokenizer's EOS always stops."""
    timeout_s: FiniteFloat = Field(300.0, gt=0)
    """Per-request timeout; a request that exceeds it is aborted and reported as a recoverable error."""


WEIGHT_SYNCS: dict[str, tuple[str, ...]] = {
    "embedded": ("in_process", "disk"),
    "vllm": ("disk", "nccl", "none"),
    "sglang": ("disk", "nccl", "none"),
    "openai": ("none",),
}
"""Each deployment kind and the weight syncs it takes, its default first: the one place the config names them.
The external kinds are `deploy.external.SERVER_KINDS`'s (a kind without weight-update endpoints takes only
`none`); the config sits below the deployments and cannot read that registry, so tests/test_registries.py
holds the two in step."""

DeploymentKind = Literal[tuple(WEIGHT_SYNCS)]
_EXTERNAL_KINDS = tuple(kind for kind in WEIGHT_SYNCS if kind != "embedded")


class DeploymentConfig(StrictModel):
    """The inference deployment rollouts sample from."""

    kind: DeploymentKind = "embedded"
    """`embedded`: an engine inside the training process, served over HTTP on `host:port`. `vllm` / `sglang`:
    a server you started at `base_url`, spoken to through its own API (README: Scaling out). `openai`: any
    OpenAI-compatible completions server that returns token ids and logprobs (sampling only, no weight sync)."""
    base_url: str | None = None
    """Root URL of an external server, e.g. `http://gpu-node:8000` (without `/v1`); required unless `embedded`."""
    replica_urls: list[str] | None = None
    """Root URLs of several servers of `kind` (vllm, sglang) serving the same model, e.g.
    `["http://gpu0:8000", "http://gpu1:8000"]`, instead of `base_url`: weights go to every live replica at once and a
    version is published only when all of them serve it; a replica that stops answering, fails its sync or serves
    another version is taken out with a warning, and re-synced before it serves again (docs/deployments.md: Several
    replicas). Without `router_url` each new trajectory goes to the replica with the fewest requests in flight and
    stays there (its affinity key)."""
    router_url: str | None = None
    """Root URL of a router in front of `replica_urls` (vllm-router for vLLM, SGLang's router for SGLang), started
    with exactly those workers: requests go through it, its own policy chooses the replica (`consistent_hash` keeps
    one trajectory on one replica: it hashes the `X-Session-ID` header the sampler sends), and a replica taken out
    is removed from it (`/remove_worker`) until it is re-synced (`/add_worker`). Needs `replica_urls`."""
    host: str = "127.0.0.1"
    """Bind address of the embedded server. Anything but loopback requires `api_key`."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the embedded server; 0 picks a free one."""
    api_key: str | None = None
    """Bearer token the embedded server requires on every endpoint but `/health`; when None it generates a
    secret per run instead (`setup.inference_api_key`). Mandatory when binding beyond loopback, so remote
    clients can be given it; sent to an external server."""
    weight_sync: Literal["in_process", "disk", "nccl", "none"] = "in_process"
    """`in_process` (embedded only): copy tensors into the engine's model; `disk`: write safetensors to `weight_dir`
    and have the server load them (the default for vllm/sglang); `nccl` (vllm/sglang, GPUs on both ends): broadcast
    the tensors into the server's GPUs; `none` (the only choice for openai): the server keeps its initial weights."""
    inflight_on_sync: Literal["finish_old", "continue_new"] = "continue_new"
    """What in-flight requests do at a weight sync: finish on the old weights (the sync waits for them),
    or pause and continue on the new weights (the embedded engine records each token's version)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights of the embedded engine's model copy; `auto`: bfloat16 where bf16 compute is native (CUDA, and CPUs
    with AVX512-BF16 or AMX, detected at run time, whose bf16 GEMMs measure at least 1.25x their float32 ones, as
    `trainer.precision`'s `auto` checks), float32 elsewhere. In-process sync converts the trainer's (float32)
    tensors on copy."""
    lora_weights: Literal["auto", "shared", "merged"] = "auto"
    """How the embedded engine holds a LoRA policy's weights (`trainer.lora_rank > 0`). `shared`: it runs the
    adapters unmerged over the trainer's own frozen base tensors, so the model is held once, a sync copies only the
    adapters, and the engine computes what the trainer differentiates; each adapted layer adds two small matmuls
    to every forward. `merged`: its own copy of the model, each sync merging the adapters in (W + scaling·B·A).
    `auto`: `shared` on a CPU where it can be (in_process sync, the engine's `dtype` the trainer's weights'),
    `merged` elsewhere. `shared` where it cannot be stops at start-up, naming why (docs/deployments.md: LoRA)."""
    decode_steps: Literal["auto", "eager", "graphs", "static"] = "auto"
    """How the embedded engine runs a decode step. `graphs` (CUDA only): captured CUDA graphs, one per (rows,
    columns) bucket, replayed without launch overhead. `eager`: a plain forward over the live rows and columns.
    `static`: the graphs' static-shape step run without capture, to tell a capture problem from a shape problem.
    `auto`: graphs on CUDA, eager elsewhere. `graphs` and `static` (chosen or set) are checked at start-up against
    the eager step on a small batch; if they raise or their logits differ beyond rounding, the engine runs eager
    steps and warns why (docs/engine-decode-loop.md: Start-up self-check). `eager` skips the check."""
    max_batch_requests: int = Field(64, gt=0)
    """Most sequences the engine decodes at once."""
    prefix_cache_bytes: int | None = Field(None, ge=0)
    """Bytes of keys/values the embedded engine keeps from recently prefilled prompts and finished sequences, so a
    prompt that starts with them (the G draws of one row, the next turn of a chat) prefills only the rest; least
    recently used first out, emptied at every weight update; 0 turns it off. Entries share the blocks of a common
    prefix (a row's draws, an agent's system prompt), counted once, and a sequence larger than the bound is not
    kept. None: 512 MiB, but at least one context's keys/values (so the longest prompt the deployment serves still
    fits: an agent's prompts are long, a CLI agent's system prompt and tool schemas alone run to 7k-20k tokens)
    and at most four contexts'. A token costs 2 x layers x KV heads x head dim x dtype bytes, 46 KB for
    SmolLM2-135M in float32 (the default is then 11.6k tokens), 12 KB for Qwen2.5-0.5B in bfloat16; only what is
    cached takes memory, and `memory_budget_gib` lowers the bound to fit (docs/engine-decode-loop.md: Prefix
    cache)."""
    max_context_tokens: int | None = Field(None, gt=0)
    """Longest prompt + completion of one request: the run's one context limit. The embedded engine serves this
    many (None: the model's `max_position_embeddings`); with an external server, None takes the `max_model_len`
    it reports, and a larger value than that is refused at start-up. The agent shim answers a prompt that leaves
    no room within it with a 400 `context_length_exceeded`, and caps each turn's max_tokens to fit it."""
    weight_sync_timeout_s: FiniteFloat = Field(600.0, gt=0)
    """Upper bound on one weight sync; exceeding it raises instead of hanging."""
    weight_dir: str | None = None
    """Where `disk` sync writes `step_<version>/` directories; an external server must see it at the same path
    (a shared filesystem). None: a private directory under the temporary one, removed at the end, or by the next
    run if this one is killed (enough for a server on this machine; docs/deployments.md)."""
    nccl_master_address: str | None = None
    """Address of this trainer that the server's GPUs reach for `nccl` sync; None: this host's address."""
    nccl_master_port: int = Field(0, ge=0, le=65535)
    """Port the trainer opens for the `nccl` rendezvous; 0 picks a free one."""
    connect_timeout_s: FiniteFloat = Field(60.0, gt=0)
    """How long start-up waits for an external server's health check (it may still be loading its model)."""

    _elsewhere: dict[str, Any] = PrivateAttr(default_factory=dict)
    """The cookbook's `DeployConfig` names given here that live in another part of the config (`sample_timeout`:
    `sampling.timeout_s`); the recipe's Config moves them there (`config/cookbook.py`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _cookbook_names(cls, data, handler):
        data, elsewhere = cookbook_config.resolve_deployment(data)
        config = handler(data)
        if elsewhere:
            config._elsewhere = elsewhere
        return config

    @model_validator(mode="before")
    @classmethod
    def _prefix_cache_bound_moved(cls, data):
        if isinstance(data, dict) and "prefix_cache_tokens" in data:
            raise ValueError("deployment.prefix_cache_tokens is now deployment.prefix_cache_bytes, the prefix cache's "
                             "one bound (a token's keys/values cost 2 x layers x KV heads x head dim x dtype bytes; "
                             "0 still turns the cache off)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _external_weight_sync_default(cls, data):
        # `in_process` cannot reach another process: an external kind defaults to what it supports.
        if isinstance(data, dict) and data.get("kind") in _EXTERNAL_KINDS and "weight_sync" not in data:
            data = {**data, "weight_sync": WEIGHT_SYNCS[data["kind"]][0]}
        return data

    @model_validator(mode="after")
    def _remote_bind_needs_key(self) -> DeploymentConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"deployment.host={self.host!r} binds beyond loopback; set deployment.api_key too")
        return self

    @model_validator(mode="after")
    def _kind_combinations(self) -> DeploymentConfig:
        allowed = WEIGHT_SYNCS[self.kind]
        several = self.replica_urls is not None or self.router_url is not None
        if several:
            self._check_replicas()
        if self.kind == "embedded":
            if self.weight_sync not in allowed:
                raise ValueError(f"deployment.weight_sync={self.weight_sync!r} is for external servers; "
                                 f"the embedded deployment takes {' or '.join(map(repr, allowed))}")
            return self
        if not several and not self.base_url:
            raise ValueError(f"deployment.kind={self.kind!r} needs deployment.base_url (e.g. 'http://localhost:8000')")
        for field, url in (("base_url", self.base_url), ("router_url", self.router_url),
                           *(("replica_urls", u) for u in self.replica_urls or ())):
            if url is not None and (not url.startswith(("http://", "https://")) or url.rstrip("/").endswith("/v1")):
                raise ValueError(f"deployment.{field}: {url!r} is not a server's root URL; give "
                                 "'http(s)://host:port' without '/v1'")
        if self.weight_sync not in allowed:
            raise ValueError(f"deployment.weight_sync={self.weight_sync!r} is not available with kind={self.kind!r}; "
                             f"use one of {allowed}")
        return self

    def _check_replicas(self) -> None:
        if self.kind not in ("vllm", "sglang"):
            raise ValueError(f"deployment.replica_urls and router_url are for kind 'vllm' or 'sglang', not "
                             f"{self.kind!r}")
        if not self.replica_urls:
            raise ValueError("deployment.router_url needs deployment.replica_urls: the servers behind the router, "
                             "which weight syncs reach one by one" if self.router_url is not None else
                             "deployment.replica_urls is empty; list the servers' root URLs")
        if self.base_url is not None:
            raise ValueError("deployment.base_url and deployment.replica_urls are both set; list every server in "
                             "replica_urls (and the router, if any, in router_url)")
        roots = [u.rstrip("/") for u in self.replica_urls]
        if len(set(roots)) != len(roots):
            raise ValueError(f"deployment.replica_urls lists a server twice: {self.replica_urls}")
        if self.router_url is not None and self.router_url.rstrip("/") in roots:
            raise ValueError(f"deployment.router_url={self.router_url!r} is also one of replica_urls")


DeployConfig = DeploymentConfig
"""The cookbook's name for `DeploymentConfig` (`deployment=DeployConfig(...)`): the same class."""


class AgentShimConfig(StrictModel):
    """The agent shim (README: The agent shim): a local Anthropic/OpenAI endpoint that records black-box agents' turns.

    Enabled, the recipes start it after the deployment and hand it to rollouts as `setup.shim`.
    The trainer owns sampling: temperature, top_p and top_k come from `sampling`, and a turn's
    max_tokens is the least of `sampling.max_tokens`, the client's own cap and the context left.
    """

    enabled: bool = False
    """Start the shim and pass it to rollouts as `setup.shim`."""
    host: str = "127.0.0.1"
    """Bind address. Every model endpoint requires a session key (a random token minted per rollout);
    binding beyond loopback exposes the shim to other machines, so do it only on a trusted network."""
    port: int = Field(0, ge=0, le=65535)
    """Port; 0 picks a free one."""
    turn_matching: Literal["message_hash", "token_prefix"] = "message_hash"
    """How a request is matched to the turns already recorded: hashes of normalized messages (default), or
    the stricter token prefix (a request continues a turn only if its fresh render starts with that turn's
    prompt + output ids)."""
    stitching: Literal["split", "repair"] = "split"
    """When a later prompt no longer token-matches an earlier output: `split` opens a new segment and loses
    no sampled token; `repair` masks or drops the unstitched tail."""
    request_timeout_s: FiniteFloat = Field(900.0, gt=0)
    """Upper bound on each wait of one request: its turn in the session's queue, sampling, writing the reply."""
    record_toolless: bool = True
    """Record requests that offer no tools as turns. False treats them as auxiliary calls (titles, summaries):
    answered, counted, never trained and never part of the session's history."""
    report_trainer_cap_as: Literal["end_turn", "max_tokens"] = "end_turn"
    """What the client hears when a reply is cut by a limit it did not ask for: `sampling.max_tokens` or the
    context left. `end_turn` (Anthropic `end_turn`, OpenAI `stop`) keeps real agents running: Claude Code reads
    `max_tokens` as its own output limit, asks three times to "resume directly" and exits 1, and the OpenAI SDK's
    `.parse()` / `.stream()` helpers raise `LengthFinishReasonError`. The price: the agent takes a cut reply for
    a finished one (a tool call cut in half arrives as text). `max_tokens` (OpenAI `length`) tells the truth and
    lets an agent that handles it continue the reply. Either way the recorded turn keeps `finish_reason="length"`
    for metrics and the reward, and a cut by the client's own smaller max_tokens is always reported as
    `max_tokens` / `length`."""
    unseen_content: Literal["refuse", "placeholder"] = "refuse"
    """Image, document, audio and other non-text blocks (also inside tool results), which a text-only prompt
    cannot carry. `refuse`: a 400 `invalid_request_error` naming the block and where it is, so the agent knows
    the model never saw it. `placeholder`: replace each with `[<type> omitted]` and answer, as if it had."""
    max_body_bytes: int | None = Field(None, gt=0)
    """Largest request body accepted; a bigger one gets a 413 (before it is read, when its size is announced).
    None derives it from the run's context (`deployment.max_context_tokens`, else what the deployment serves): the
    most a prompt of that many tokens can take as JSON (each token the
    tokenizer's longest, each byte a six-byte `\\uXXXX` escape), but at least 32 MiB, the Anthropic API's own
    limit, so no body a real provider takes is refused. The shim's `/healthz` reports the limit in force."""
    max_body_bytes_in_flight: int | None = Field(None, gt=0)
    """Most request-body bytes the shim holds at once, across all requests: a request's share (its Content-Length,
    or `max_body_bytes` when it announces none) is taken before its body is read and given back when it is
    answered. A request that finds no room waits in arrival order, and gets a 503 if none comes within
    `client_timeout_s`. None: 8 x `max_body_bytes`. Never below `max_body_bytes`."""
    client_timeout_s: FiniteFloat = Field(60.0, gt=0)
    """How long the shim waits on a client's connection: for a request's headers (on a new connection, or after
    its previous request: idle keep-alive connections too), for a request's whole body (a 408 otherwise), and for
    the client to take any of a reply it was sent. Past it the connection is closed. Well above the few seconds
    for which HTTP clients keep idle connections of their own, so no client reuses one the shim closed."""
    session_idle_timeout_s: FiniteFloat = Field(1800.0, gt=0)
    """A session with no request in flight and none for this long expires: it is dropped, its agent gets a 401
    "session expired", and `finish_session` raises `SessionExpiredError` (recoverable: the draw is dropped).
    Counted in `setup.shim.stats["sessions_expired"]`."""
    max_open_sessions: int = Field(1024, gt=0)
    """Most sessions open at once (the shim's 429): `open_session` beyond it raises `SessionLimitError`
    (recoverable: the draw is dropped) until sessions are finished, discarded or expire."""
    max_connections: int = Field(512, gt=0)
    """Most connections open at once on the shim's TCP port (in-process clients, unsandboxed agents); one more is
    closed as it opens, so a connection flood holds a bounded number of file descriptors."""
    max_connections_per_session: int = Field(16, gt=0)
    """Most connections open at once on a sandboxed agent's own socket (its session's); one more is closed as it
    opens. An agent and its sub-agents need a few."""
    max_request_items: int = Field(50_000, gt=0)
    """Most JSON objects and arrays (messages, content blocks, tools, their schemas) one request may hold, counted
    before the body is parsed (a 413 beyond it): a parsed object costs hundreds of bytes however short its text.
    Real agents' requests hold a few thousand."""
    max_request_memory_in_flight: int = Field(512 * 2**20, gt=0)
    """Most bytes that parsed requests may take at once, estimated from their size and item count before parsing:
    process-wide this many, one session half of it. A request that finds no room waits in arrival order (a 503
    after `client_timeout_s`); one larger than a session's share is a 413."""

    @model_validator(mode="before")
    @classmethod
    def _context_limit_moved(cls, data):
        if isinstance(data, dict) and "max_context_tokens" in data:
            raise ValueError("agent_shim.max_context_tokens is now deployment.max_context_tokens, the run's one "
                             "context limit (the shim enforces it on every turn); set it there")
        return data

    @model_validator(mode="after")
    def _room_for_one_body(self) -> AgentShimConfig:
        if None not in (self.max_body_bytes, self.max_body_bytes_in_flight) and (
                self.max_body_bytes_in_flight < self.max_body_bytes):
            raise ValueError(f"agent_shim.max_body_bytes_in_flight={self.max_body_bytes_in_flight} is below "
                             f"max_body_bytes={self.max_body_bytes}: a body of the largest size could never be read")
        return self
