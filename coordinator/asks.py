"""The validation want: VALIDATE asks that stay open side by side.

A worker scores a copy of step s's weights while it trains on (SPEC §8 Validation), so its
VALIDATION of s may come after the run has committed s + 1, ..., and after s + every_steps
has been asked for. Each ask stays open until its own answer, or until its worker leaves;
every answer is recorded under its own step. Pure, as the run core that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .core_types import Peer, Want

__all__ = ["OpenAsks"]


@dataclass
class OpenAsks(Want):
    """A `Want` whose asks do not replace each other: (peer, step) pairs awaited."""

    open: set[tuple[int, int]] = field(default_factory=set)

    def ask(self, peer: Peer) -> int:
        step = super().ask(peer)
        self.open.add((peer.id, step))
        return step

    def answered(self, peer_id: int, step: int) -> bool:
        """Whether (peer_id, step) was asked and not yet answered; it is awaited no more."""
        if (peer_id, step) not in self.open:
            return False
        self.open.discard((peer_id, step))
        if self.asked == (peer_id, step):
            self.asked = None
        return True

    def drop(self, peer_id: int) -> int | None:
        """`peer_id` will not answer: none of its asks is awaited; the newest step among
        them, None when it had none."""
        mine = {ask for ask in self.open if ask[0] == peer_id}
        self.open -= mine
        super().drop(peer_id)
        return max((step for _, step in mine), default=None)

    def pending(self, step: int) -> bool:
        return self.step == step or any(s == step for _, s in self.open)
