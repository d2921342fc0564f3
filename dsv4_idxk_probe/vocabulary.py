"""The probe's shared words and DeepSeek-V4 numbers, defined once.

Everything else imports these names instead of spelling them out: the room-log
schema version, the stages and verdicts of a room, the diagnosis kinds, the
patch-target statuses, the HiCache copy branches, and the index-K geometry of
DeepSeek-V4. This module imports nothing of the package (it is the bottom
floor; docs/architecture.md) and nothing heavy, so the offline tools and the
metrics read it for free. docs/glossary.md says what each word means.
"""

from __future__ import annotations

# --- room logs -------------------------------------------------------------

#: Version of the room-log record schema (docs/roomlog.md).
SCHEMA_VERSION = 1

# --- a room's life across prefill and decode --------------------------------

#: Where a room's index-K is digested, in the order a room meets them (docs/pd.md).
STAGES = ("prefill_send", "decode_recv", "decode_step", "decode_finish")
#: The stages that are compared with prefill's `prefill_send`.
DECODE_STAGES = STAGES[1:]
#: What a comparison at a stage concludes.
VERDICTS = ("match", "mismatch", "not_comparable", "unverified", "skipped")
#: How bad a verdict is, for "the worst stage of a room" (higher is worse).
SEVERITY = {"mismatch": 4, "not_comparable": 3, "unverified": 2, "match": 1, "skipped": 0}

# --- diagnosis ------------------------------------------------------------

#: What a corrupt cell's bytes became (docs/diagnosis.md).
DIAGNOSIS_KINDS = ("zeroed", "other_room", "previous_occupant", "unknown")

# --- patch targets --------------------------------------------------------

#: What became of one patch target: patched (wrapped and verified); pending
#: (waiting for its module's import or SGLang's hook registry); missing (not in
#: the installed SGLang); signature_changed (present, parameters differ);
#: hook_error (our hook could not be built); not_applied (wrapping raised or did
#: not take).
PATCH_STATUSES = ("patched", "pending", "missing", "signature_changed", "hook_error", "not_applied")

# --- HiCache host-pool copies ----------------------------------------------

#: Which code path one host-pool copy call took (docs/hicache.md).
HICACHE_BRANCHES = ("page", "token_dsv4_mla", "token_rejected", "empty", "size_mismatch", "unsupported")
#: Copy directions: device to host (backup) and host to device (load).
HICACHE_DIRECTIONS = ("d2h", "h2d")
#: Where prefill compares HiCache restores (docs/hicache.md, "Restore verification"):
#: the device pages a load wrote against what their backup read. Kept apart from
#: `STAGES` (a room's PD stages, whose users compare them with `prefill_send`); its
#: verdicts and cells go to the same metrics under this stage.
HICACHE_STAGES = ("hicache_load",)

# --- coverage: every index-K byte that moves, verified or counted as not ----

#: Where index-K bytes move (docs/coverage.md): prefill to decode; device to
#: host pool (backup); host pool to device (load); storage tier to host (l3).
COVERAGE_PATHS = ("pd", "hicache_backup", "hicache_load", "l3")
#: What became of those bytes' verification.
COVERAGE_OUTCOMES = ("verified", "unverified", "not_comparable", "skipped")
#: Why bytes were not verified (low cardinality; "none" when they were).
COVERAGE_REASONS = (
    "none", "layout_unknown", "no_exchange", "pp_stage", "truncated_by_transfer", "host_dest",
    "metadata_on_device", "digest_lost", "probe_error", "queue_full", "disabled", "other",
    # PD rooms (docs/coverage.md): layouts or lengths that differ for no known cause; rooms
    # SGLang retracted, aborted or whose transfer failed before any verdict; rooms pushed
    # out of decode's tracking table before any verdict.
    "layout_differs", "length_differs", "retracted", "aborted", "transfer_failed", "evicted",
    # index-K SGLang's direct external linker loads from storage into device pages (no host pool)
    "direct_linker",
)

# --- DeepSeek-V4 index-K geometry ------------------------------------------

#: Tokens per compressed (C4) index-K slot: the indexer keeps one key per 4 tokens.
C4_RATIO = 4
#: Tokens per KV page in SGLang's DeepSeek-V4 pools.
PAGE_TOKENS = 256
#: C4 slots per page: one index-K row holds this many keys.
SLOTS_PER_PAGE = PAGE_TOKENS // C4_RATIO
#: The indexer's head dimension (fp8 payload bytes per key).
INDEX_HEAD_DIM = 128
