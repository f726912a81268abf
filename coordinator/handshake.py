"""The handshake's rules (SPEC §8, Handshake): HELLO's protocol version, then AUTH's MAC by
the run's token or an enrolled worker's credential, then WELCOME. Handlers of `RunCore`
(run.py), kept here so that the core's file holds the job flow."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from ..protocol import PROTOCOL_VERSION, ErrorCode, messages, verify_mac
from ..protocol.security import CREDENTIAL_PREFIX, worker_credential
from .core_types import Output, Peer, Send
from .events import Joined, NameShared, Overprovisioned

if TYPE_CHECKING:
    from .run import RunCore

__all__ = ["on_auth", "on_hello"]


def on_hello(core: RunCore, peer: Peer, msg: messages.Hello) -> list[Output]:
    """A worker's name and data digest; a CHALLENGE, or BAD_VERSION."""
    peer.name, peer.data_digest = msg.worker_name, msg.data_digest
    if msg.protocol_version != PROTOCOL_VERSION:
        raise core.refuse(
            peer,
            ErrorCode.BAD_VERSION,
            f"coordinator speaks protocol "
            f"{PROTOCOL_VERSION}, worker {msg.protocol_version}: upgrade the older one",
        )
    peer.nonce = secrets.token_bytes(32)
    return [Send(peer.id, messages.Challenge(peer.nonce))]


def on_auth(core: RunCore, peer: Peer, msg: messages.Auth) -> list[Output]:
    """The MAC of the nonce by the token or the name's credential; then WELCOME."""
    if not verify_mac(core.options.token, peer.nonce, msg.mac):
        # Not the run's token: an enrolled worker's credential, which names its machine.
        credential = worker_credential(core.options.token, peer.name)
        if credential is None or not verify_mac(credential, peer.nonce, msg.mac):
            raise core.refuse(
                peer,
                ErrorCode.AUTH_FAILED,
                "wrong token: give the coordinator's token, or the credential enrolled "
                "for this --name (--token-file or EGGROLL_TOKEN)",
            )
        peer.machine = peer.machine or CREDENTIAL_PREFIX + peer.name  # a certificate's wins
    out: list[Output] = list(core.trust.check_data_digest(peer))
    snapshot = core.store.latest_snapshot
    welcome = messages.Welcome(
        core.store.run_id,
        core.config_bytes,
        core.step,
        -1 if snapshot is None else snapshot,
        core.cfg.pairs,
    )
    peer.ready = True
    peer.worked = core.clock()
    out += core.trust.join(peer)
    peer.broadcast_from = core.step
    out.append(Joined(peer.name, peer.address, core.ready_count(), peer.machine))
    twin = next(
        (p for p in core.peers.values() if p.ready and p is not peer and p.name == peer.name),
        None,
    )
    if twin is not None:
        out.append(NameShared(peer.name, peer.address, twin.address))
    if core.ready_count() == core.cfg.chunks + 1:
        out.append(Overprovisioned(core.ready_count(), core.cfg.chunks, core.cfg.es.chunk_size))
    return [*out, Send(peer.id, welcome)]
