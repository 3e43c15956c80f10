"""The messages between the API process and rank 0's engine loop: typed msgpack, never pickle.

Two ZeroMQ PUSH → PULL pipes, both bound by rank 0 in the run's private 0700 directory
(`tp_engine.server.ipc`), so that the API process, started later, only ever connects:

    to_engine.sock   API process ──► rank 0     Ready, AddRequest, AbortRequest, Control
    to_api.sock      rank 0 ──► API process     Hello, EngineOutputs, Drain, Dead, Exit,
                                                ControlReply

One frame per message: a msgspec `Struct` encoded as a msgpack map of its fields by name, with
its class name under "kind" (a tagged union). One encoder and one decoder serve every message
(`encode`, `decode`); the decoder knows every message's type, so a frame with an unknown kind, a
missing or unknown field or a value of the wrong type is refused with `MessageError` naming it,
and a peer of another version fails loudly instead of misreading. Records inside a message
are typed too: `Rejected`, `Delta`, `EngineStats`, an adapter as `LoRARequest` and a position's
log-probabilities as `TokenLogprobs` (the engine's own plain values), never positional lists.

A request's life, seen from the API process:

    AddRequest ──► accepted ──► deltas of each sample … its delta(finish_reason) ──► done
               └─► rejected(status, message)                    (nothing else follows)
    AbortRequest (client gone, or a stop string matched) ends samples early; rank 0 sends
    nothing more for them. Dead ends every request at once.

A pooling request (AddRequest with pooling_params) has one sample and one Delta: no tokens,
finish_reason "stop" and the pooled vector.

Control calls (pause, resume, weight updates, sleep: `tp_engine.server.rank0.control_ops`) are the
one request/reply exchange: `Control(call_id, op, args)` runs on rank 0 between two steps and
`ControlReply(call_id, ...)` answers it once it is done (a pause in "wait" mode: once the
running requests have finished).

The engine's gauges travel in every EngineOutputs (`EngineStats`), sent after each loop
iteration that changed anything, so /metrics reads rank 0's numbers without asking.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shm_ipc import wire
from tp_engine.core.outputs import EngineStats
from tp_engine.core.sequence import TokenLogprobs
from tp_engine.lora_request import LoRARequest


class MessageError(ValueError):
    """A frame that is not a message of this protocol version."""


class Hello(wire.Message, frozen=True):
    """rank 0 → API: the engine is up; what the API needs to know about it."""

    # Checkpoint directory: the API process loads the tokenizer and chat template from it.
    model_dir: str
    # The names clients may put in "model"; the first is the one responses carry.
    served_model_names: list[str]
    # Prompt + completion limit: the API refuses longer requests before they reach rank 0.
    max_model_len: int
    # Rows of the embedding: prompt token ids must be below this.
    vocab_size: int
    # SamplingParams defaults from the checkpoint's generation_config.json, for the fields a
    # request leaves unset (`SamplingParams.from_optional`).
    generation_defaults: dict[str, Any]
    # Bearer token clients must send on /v1 routes; None = no authentication. Travels here
    # (not on the command line) so that `ps` does not show it.
    api_key: str | None
    tensor_parallel_size: int
    # --reasoning-parser, --tool-call-parser, --enable-auto-tool-choice: how the API process
    # splits chat output into reasoning, content and tool calls (`chat_parsers`).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # `guards.RequestLimits.to_wire()`: body size, allowed Host names, what needs the key,
    # constraint limits. Empty: the defaults.
    limits: dict[str, Any] = msgspec.field(default_factory=dict)
    # --enable-weight-updates, --enable-sleep-mode: which admin routes the API process offers.
    enable_weight_updates: bool = False
    enable_sleep_mode: bool = False
    # What the model serves, vLLM's task names: "generate", or some of "embed", "classify",
    # "score" for a pooling model. The API process offers only the routes of these tasks.
    supported_tasks: list[str] = msgspec.field(default_factory=lambda: ["generate"])
    # Length of a pooled embedding (the hidden size): the largest `dimensions` a request asks.
    pooled_size: int = 0
    # Whether `dimensions` may cut embeddings (Matryoshka training); a 400 otherwise.
    is_matryoshka: bool = False
    # A classifier's class names by index (the checkpoint's id2label): /classify's `label`.
    # Empty: vLLM's default names, LABEL_<i>.
    class_labels: list[str] = msgspec.field(default_factory=list)
    # --enable-lora: the adapters loaded at start-up (--lora-modules); the API process serves
    # them by name.
    enable_lora: bool = False
    lora_modules: list[LoRARequest] = msgspec.field(default_factory=list)
    # --enable-weight-updates-from-tensor: SGLang's /update_weights_from_tensor is offered.
    enable_weight_updates_from_tensor: bool = False
    # --tokenizer: the directory the tokenizer files come from (rank 0 loads the same one);
    # None: model_dir. --chat-template: the template's text, replacing the tokenizer's.
    tokenizer_dir: str | None = None
    chat_template: str | None = None
    # --disaggregation-mode: "null", "prefill" or "decode" (SGLang's /server_info reports it).
    disaggregation_mode: str = "null"


class Ready(wire.Message, frozen=True):
    """API → rank 0: the HTTP socket is listening."""

    # The port the HTTP server listens on (the real one when --port 0 asked for any).
    port: int


class Bootstrap(wire.Record, frozen=True):
    """Where a request's prefill/decode pair meets (SGLang's `bootstrap_host`,
    `bootstrap_port`, `bootstrap_room`, as sglang-router adds them): the prefill's bootstrap
    server (port None: the decode's own --disaggregation-bootstrap-port) and the room."""

    host: str
    port: int | None
    room: int


class AddRequest(wire.Message, frozen=True):
    """API → rank 0: a new request (one per prompt; its n samples come back by index)."""

    # Unique among live requests; the API makes it from the HTTP request id and prompt index.
    request_id: str
    prompt_token_ids: list[int]
    # `SamplingParams` fields by name (validated by the API, checked again by the engine).
    # `n` > 1 makes n samples, reported by their index (the engine shares the prompt's blocks).
    # Empty for a pooling request.
    sampling_params: dict[str, Any]
    # `PoolingParams` fields by name: the request pools its prompt instead of sampling (one
    # Delta comes back, carrying `pooled`). None for a generation request.
    pooling_params: dict[str, Any] | None = None
    # Its LoRA adapter; None: the base model. Rank 0 refuses (404) an adapter unloaded
    # meanwhile.
    lora_request: LoRARequest | None = None
    # The output constraint's parses, in order: each `StructuredOutputsParams` fields by the
    # request's field it names. Rank 0 runs them before the engine sees the request (a 400
    # naming that field: `Rejected.param`), because parsing imports xgrammar, and so torch,
    # which the API process never loads (`tp_engine.server.api.constraints`).
    constraint_checks: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # Set by a prefill/decode router: the request's half of a pair (`rank0.disagg`); None: a
    # request of its own (served whole, whatever the server's role).
    bootstrap: Bootstrap | None = None


class AbortRequest(wire.Message, frozen=True):
    """API → rank 0: stop a request (or some of its samples), free their KV blocks."""

    request_id: str
    # The samples to stop; None = every sample of the request.
    sample_indices: list[int] | None
    # True: a stop string ended them (finished "stop"); False: the client went away.
    stopped: bool


class Control(wire.Message, frozen=True):
    """API → rank 0: an operation on the running engine (an admin route)."""

    # Unique per API process; the reply carries it back.
    call_id: int
    # An operation of `tp_engine.server.rank0.control_ops.OPS` (refused by name otherwise).
    op: str
    # Its arguments by name, msgpack data, checked by the operation.
    args: dict[str, Any]


class ControlReply(wire.Message, frozen=True):
    """rank 0 → API: how a Control ended."""

    call_id: int
    # HTTP status for the route: 200 done, 400 refused (nothing changed), 503 engine dead.
    status: int
    # Why, when refused; empty on success.
    message: str
    # What the operation returns (e.g. {"weight_version": ...}); msgpack data.
    result: dict[str, Any]


class Rejected(wire.Record, frozen=True):
    """`add_request` refused the request; no other message about it follows."""

    request_id: str
    # HTTP status for the client: 400 for an invalid request, 503 while shutting down.
    status: int
    message: str
    # The request's field at fault (OpenAI's error `param`), when one is.
    param: str | None = None


class Delta(wire.Record, frozen=True, omit_defaults=True):
    """New tokens of one sample since its last Delta, and how it ended if it did. The many
    Deltas of a step leave out their None fields on the wire (`omit_defaults`)."""

    request_id: str
    # Which of the request's n samples (0 when n == 1).
    index: int
    new_token_ids: list[int]
    # "stop" (EOS or a stop token id), "length" or "abort"; None while it runs. Stop strings
    # are the API's business: rank 0 never reports them.
    finish_reason: str | None = None
    # The stop token id that ended it, if one did.
    stop_reason: int | None = None
    # Prompt tokens served from the prefix cache; in the first Delta only.
    num_cached_tokens: int | None = None
    # Seconds from arrival on rank 0 to the first step that scheduled it; first Delta only.
    queue_time_s: float | None = None
    # Per new token when logprobs were asked for: the sampled token first, then the top-k;
    # else None.
    logprobs: list[TokenLogprobs] | None = None
    # Per prompt token (None for the first) when prompt_logprobs were asked for; in sample 0's
    # first Delta only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's result, in its final Delta: little-endian float32 bytes (an
    # embedding, or one score per label), as compact as msgpack carries bytes.
    pooled: bytes | None = None
    # time.monotonic() on rank 0 of the first step that scheduled it (CLOCK_MONOTONIC, the
    # API process's clock too); first Delta only. /metrics' prefill and inference times start
    # here.
    scheduled_at: float | None = None
    # Why the sample failed on its own (finish_reason "abort"): a prefill/decode transfer; the
    # API answers 500 with it. None: it did not.
    error: str | None = None


class EngineOutputs(wire.Message, frozen=True):
    """rank 0 → API: acceptances, rejections, new tokens and stats of one iteration."""

    accepted: list[str]
    rejected: list[Rejected]
    deltas: list[Delta]
    stats: EngineStats


class Drain(wire.Message, frozen=True):
    """rank 0 → API: shutting down: refuse new requests, let in-flight ones finish."""

    # Seconds rank 0 gives in-flight requests before it aborts them.
    timeout_s: float


class Dead(wire.Message, frozen=True):
    """rank 0 → API: the engine cannot step any more; fail everything, answer 503."""

    # What failed, naming the rank and step when known.
    message: str


class Exit(wire.Message, frozen=True):
    """rank 0 → API: every request is over; stop the HTTP server and exit."""

    # The exit code rank 0 will return (the API process exits with it too).
    code: int = 0


Message = (
    Hello
    | Ready
    | AddRequest
    | AbortRequest
    | EngineOutputs
    | Drain
    | Dead
    | Exit
    | Control
    | ControlReply
)
# Made once: the decoder keeps the union's schema between calls (the encoder is `wire`'s).
_DECODER = wire.decoder(Message)


def encode(msg: Message) -> bytes:
    return wire.encode(msg)


def decode(frame: bytes) -> Message:
    """The message in `frame`; raises MessageError on anything else."""
    return wire.decode(_DECODER, frame, MessageError, "not a message of this protocol")


__all__ = [
    "AbortRequest",
    "AddRequest",
    "Control",
    "ControlReply",
    "Dead",
    "Delta",
    "Drain",
    "EngineOutputs",
    "EngineStats",
    "Exit",
    "Hello",
    "LoRARequest",
    "Message",
    "MessageError",
    "Ready",
    "Rejected",
    "TokenLogprobs",
    "decode",
    "encode",
]
