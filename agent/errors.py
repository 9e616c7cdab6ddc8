"""Typed errors: one for bad input, one for the kernel refusing a transaction."""
from __future__ import annotations


class RuleError(Exception):
    """An input object that cannot be used, with the object, field and reason named."""

    def __init__(self, kind: str, name: str, field: str, reason: str, uid: str = "", version: str = "") -> None:
        self.kind = kind
        self.name = name
        self.field = field
        self.reason = reason
        self.uid = uid  # of the object, so an Event can point at it
        self.version = version  # its resourceVersion: a new one is a new change, reported anew
        super().__init__(f"{kind} {name!r}: {field}: {reason}")

    def key(self) -> tuple[str, ...]:
        return (self.kind, self.name, self.field, self.reason, self.version)


class ApplyError(Exception):
    """libnftables rejected a transaction; nothing of it was applied (batches are atomic).
    `partial`: an earlier transaction of the same apply had committed (Nft.apply splits
    one only to redeclare a map someone else altered), so the kernel did change."""

    def __init__(self, rc: int, message: str, digest: str, commands: int, partial: bool = False) -> None:
        self.rc = rc
        self.message = message.strip()
        self.digest = digest
        self.commands = commands
        self.partial = partial
        super().__init__(f"nftables rc={rc} digest={digest} commands={commands}: {self.message}")
