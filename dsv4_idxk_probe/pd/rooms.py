"""Room identity: the logical key both sides agree on."""

from __future__ import annotations


class RoomId:
    """A request's bootstrap room plus the transfer attempt (retries resend from scratch).

    A value: equal and hashing alike by (room, attempt); treat it as immutable. Its `key`
    ("room/attempt", what records, tables and the exchange use) is made with it: every
    hook asks for it, on the serving thread, and a plain slot read costs no call there (a
    frozen dataclass with a cached property cost two Python calls at the first read)."""

    __slots__ = ("room", "attempt", "key")

    def __init__(self, room: int, attempt: int = 0):
        self.room = room
        self.attempt = attempt
        self.key = f"{room}/{attempt}"

    def __eq__(self, other):
        if other.__class__ is not RoomId:
            return NotImplemented
        return self.room == other.room and self.attempt == other.attempt

    def __hash__(self):
        return hash((self.room, self.attempt))

    def __repr__(self):
        return f"RoomId(room={self.room!r}, attempt={self.attempt!r})"

    def __reduce__(self):
        return RoomId, (self.room, self.attempt)

    @classmethod
    def from_key(cls, key: str) -> "RoomId":
        room, _, attempt = key.partition("/")
        return cls(int(room), int(attempt or 0))
