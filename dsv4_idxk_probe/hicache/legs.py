"""The three legs of a host row's round trip, and what each check can say: plain
names, shared by the round-trip checks and the log tools that read their records
(which must not import torch)."""

LEGS = ("d2h", "host", "h2d")
LEG_NAMES = {"d2h": "device-to-host copy", "host": "host memory while resident", "h2d": "host-to-device copy"}
VERDICTS = ("match", "mismatch", "unverified")
