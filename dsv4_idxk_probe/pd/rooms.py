"""Room identity: the logical key both sides agree on."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class RoomId:
    """A request's bootstrap room plus the transfer attempt (retries resend from scratch)."""

    room: int
    attempt: int = 0

    @cached_property  # made once: the hooks ask for it several times per call
    def key(self) -> str:
        return f"{self.room}/{self.attempt}"

    @classmethod
    def from_key(cls, key: str) -> "RoomId":
        room, _, attempt = key.partition("/")
        return cls(int(room), int(attempt or 0))
