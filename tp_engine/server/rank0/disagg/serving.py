"""What rank 0's process does for its role (`--disaggregation-mode`): bind the agents' address
before the engine starts (`prepare`), meet the ranks' agents once it has (`start`), then the
few calls the engine loop makes (`add`, `holds`, `aborted`, `poll`).

A request without bootstrap fields (a user's own, the router's health check) runs as on any
server, computed here; with them it takes this server's role. The address everything binds:
`$TP_ENGINE_HOST_IP`, else the server's `--host` when it names one address, else the one that
routes to `MASTER_ADDR` (`shm_ipc.remote.announce_host`), else 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shm_ipc.remote import ENV_HOST_IP, announce_host
from tp_engine.core.outputs import SequenceOutput
from tp_engine.server.disagg_flags import DisaggregationOptions
from tp_engine.server.messages import AddRequest
from tp_engine.server.rank0.disagg.agents import AgentHub
from tp_engine.server.rank0.disagg.decode import DecodeRooms
from tp_engine.server.rank0.disagg.prefill import PrefillRooms

logger = logging.getLogger(__name__)

__all__ = ["Disaggregation", "NoRole"]

# How long rank 0 waits for every rank's agent after the engine is up.
_AGENTS_TIMEOUT_S = 60.0


class NoRole:
    """A regular server's stand-in for `Disaggregation`: every request is its own."""

    busy = False

    def add(self, engine: Any, msg: AddRequest, params: Any, lora: Any) -> list[str]:
        return engine.add_request(msg.request_id, msg.prompt_token_ids, params, lora_request=lora)

    def holds(self, out: SequenceOutput) -> bool:
        return False

    def aborted(self, seq_id: str) -> None:
        pass

    def poll(self) -> list[tuple[SequenceOutput, str | None]]:
        return []


class Disaggregation(NoRole):
    """See the module docstring."""

    def __init__(self, options: DisaggregationOptions, server_host: str) -> None:
        self.options = options
        self.server_host = server_host
        self.hub = AgentHub(_node_host(server_host))
        self.rooms: PrefillRooms | DecodeRooms | None = None

    @classmethod
    def prepare(cls, options: DisaggregationOptions, server_host: str) -> Disaggregation | None:
        """None unless the server has a role; a decode with the fake backend moves nothing and
        needs no agents (`settings` None)."""
        return cls(options, server_host) if options.enabled else None

    def settings(self) -> dict[str, str] | None:
        """`EngineConfig.disaggregation`: what every rank's agent is told."""
        if not self.options.moves_kv:
            return None
        return self.hub.settings(self.options)

    def start(self, engine: Any) -> None:
        """The engine is up: wait for the ranks' agents, then serve the role."""
        world = engine.config.tensor_parallel_size * engine.config.pipeline_parallel_size
        hellos = self.hub.wait_for_ranks(world, _AGENTS_TIMEOUT_S) if self.settings() else []
        facts = _facts(engine, hellos)
        if self.options.mode == "prefill":
            self.rooms = PrefillRooms(engine, self.options, self.hub, self.server_host, facts)
        else:
            self.rooms = DecodeRooms(engine, self.options, self.hub, facts)
        self.rooms.start(hellos)
        logger.info(
            "disaggregation: %s server, transfer backend %s, agents on %s",
            self.options.mode,
            self.options.backend,
            self.hub.endpoint,
        )

    def add(self, engine: Any, msg: AddRequest, params: Any, lora: Any) -> list[str]:
        """Add a request in this server's role (a regular one without bootstrap fields)."""
        rooms = self.rooms
        if msg.bootstrap is None or rooms is None:
            return super().add(engine, msg, params, lora)
        if getattr(params, "n", 1) != 1:
            raise ValueError("n > 1 is not supported with prefill/decode disaggregation yet")
        if rooms.in_use(msg.bootstrap.room):
            raise ValueError(f"bootstrap_room {msg.bootstrap.room} is in use by another request")
        if isinstance(rooms, PrefillRooms):
            params = type(params)(**rooms.params(msg))
        role = "prefill" if isinstance(rooms, PrefillRooms) else "decode"
        seq_ids = engine.add_request(
            msg.request_id, msg.prompt_token_ids, params, lora_request=lora, disaggregation=role
        )
        rooms.added(msg, seq_ids[0])
        return seq_ids

    def holds(self, out: SequenceOutput) -> bool:
        """Whether the loop must not send `out` yet (a prefill's answer before its pages are
        written); `poll` releases it."""
        return isinstance(self.rooms, PrefillRooms) and self.rooms.holds(out)

    def aborted(self, seq_id: str) -> None:
        if self.rooms is not None:
            self.rooms.aborted(seq_id)

    def poll(self) -> list[tuple[SequenceOutput, str | None]]:
        return [] if self.rooms is None else self.rooms.poll()

    @property  # type: ignore[override]
    def busy(self) -> bool:
        return self.rooms is not None and self.rooms.busy

    def close(self) -> None:
        if self.rooms is not None:
            self.rooms.close()
        self.hub.close()


def _node_host(server_host: str) -> str:
    explicit = os.environ.get(ENV_HOST_IP)
    if explicit:
        return explicit
    if server_host not in ("", "0.0.0.0", "::"):
        return server_host
    return announce_host()


def _facts(engine: Any, hellos: list[Any]) -> dict[str, Any]:
    """What a prefill and a decode must agree on (compared by the decode, named in its
    refusal): the page layout, the KV dtype and the model's shape."""
    hf = engine.runner.hf_config
    facts: dict[str, Any] = {
        "page_size": engine.config.block_size,
        "kv_cache_dtype": str(engine.runner.kv_spec.dtype).removeprefix("torch."),
        "model_type": getattr(hf, "model_type", None),
        "num_layers": hf.num_hidden_layers,
        "vocab_size": engine.vocab_size,
    }
    if hellos:
        facts["block_bytes"] = hellos[0].region.block_bytes
    return facts
