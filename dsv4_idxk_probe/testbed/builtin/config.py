"""The rig's knobs and its room plan, decided once in the parent.

Both children receive the same plan, so prefill and decode agree on every
room's length, decode-side prefix and decode steps without talking about it,
and a fault spec's room fractions resolve to the same rooms on both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..faults.plan import PAGE_TOKENS, PlanError, RoomPlan, explicit_plan
from .modeltime import STEP_WAITS

__all__ = ["PAGE_TOKENS", "PlanError", "RigConfig", "RoleEnv", "RoomPlan", "explicit_plan", "plan_rooms"]

MAX_LAYERS = 61

DEVICES = ("cpu", "cuda")
POOL_SOURCES = ("auto", "sglang", "builtin")


@dataclass(frozen=True)
class RigConfig:
    """Everything that shapes one rig run (the probe's own knobs come from its env)."""

    rooms: int = 200
    layers: int = 8
    layer_ids: tuple[int, ...] | None = None  # default: 0..layers-1
    layout: str = "fp8"
    seed: int = 0
    min_tokens: int = 64
    max_tokens: int = 3000
    chunk_tokens: int = 1024  # chunked prefill; a multiple of the page size
    prefix_fraction: float = 0.25  # rooms with a decode-side prefix
    min_steps: int = 8
    max_steps: int = 48
    max_running: int = 16  # decode concurrency
    pool_pages: int = 0  # per layer and side; 0 = enough for max_running rooms
    device: str = "cpu"
    prefill_gpu: int = 0
    decode_gpu: int = 0
    pool_source: str = "auto"
    oracle: bool = True  # decode checks frozen bytes against ground truth at every digest point
    transfer_timeout_s: float = 20.0
    serial_writes: bool = False  # prefill waits for each WRITE: exact per-WRITE timing (benchmarks)
    decode_step_ms: float = 0.0  # model time per decode batch step (benchmarks); 0 = transport only
    decode_step_wait: str = "sleep"  # how that model time passes: one of modeltime.STEP_WAITS
    exchange_address: str | None = None  # decode asks here instead of prefill's announced address
    plan: tuple[RoomPlan, ...] | None = None  # explicit rooms (tests); overrides rooms/tokens/steps

    def validated(self) -> "RigConfig":
        """Check every field; return self with `layer_ids` filled in."""
        if not 1 <= self.layers <= MAX_LAYERS:
            raise PlanError(f"layers must be 1..{MAX_LAYERS}, got {self.layers}")
        ids = tuple(range(self.layers)) if self.layer_ids is None else tuple(int(i) for i in self.layer_ids)
        if len(ids) != self.layers or len(set(ids)) != len(ids) or min(ids) < 0:
            raise PlanError(f"layer_ids must be {self.layers} distinct non-negative ids, got {list(ids)}")
        if self.plan is None and self.rooms < 1:
            raise PlanError(f"rooms must be >= 1, got {self.rooms}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise PlanError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.chunk_tokens < PAGE_TOKENS or self.chunk_tokens % PAGE_TOKENS:
            raise PlanError(f"chunk_tokens must be a positive multiple of {PAGE_TOKENS}, got {self.chunk_tokens}")
        if not 0.0 <= self.prefix_fraction <= 1.0:
            raise PlanError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction}")
        if not 0 <= self.min_steps <= self.max_steps:
            raise PlanError(f"need 0 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.decode_step_ms < 0:
            raise PlanError(f"decode_step_ms must be >= 0, got {self.decode_step_ms}")
        if self.decode_step_wait not in STEP_WAITS:
            raise PlanError(f"decode_step_wait must be one of {', '.join(STEP_WAITS)}, got {self.decode_step_wait!r}")
        if self.decode_step_wait == "gpu" and self.device != "cuda":
            raise PlanError("decode_step_wait 'gpu' needs device 'cuda'")
        if self.max_running < 1:
            raise PlanError(f"max_running must be >= 1, got {self.max_running}")
        if self.device not in DEVICES:
            raise PlanError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.pool_source not in POOL_SOURCES:
            raise PlanError(f"pool_source must be one of {', '.join(POOL_SOURCES)}, got {self.pool_source!r}")
        if self.prefill_gpu < 0 or self.decode_gpu < 0:
            raise PlanError("prefill_gpu and decode_gpu must be CUDA device indices >= 0")
        need = self.pages_needed()
        if self.pool_pages and self.pool_pages < need:
            raise PlanError(f"pool_pages={self.pool_pages} cannot hold the largest room plus page 0 ({need})")
        return replace(self, layer_ids=ids)

    def room_plan(self) -> tuple[RoomPlan, ...]:
        return self.plan if self.plan is not None else plan_rooms(self)

    def max_room_pages(self) -> int:
        plan = self.room_plan()
        return max(r.total_pages for r in plan)

    def pages_needed(self) -> int:
        """Smallest pool that can hold one room, plus the reserved page 0."""
        return self.max_room_pages() + 1

    def pool_size(self) -> int:
        """Pages per layer on each side: enough for every running room, so admission never starves."""
        return self.pool_pages or (self.max_running * self.max_room_pages() + 1)


def plan_rooms(cfg: RigConfig) -> tuple[RoomPlan, ...]:
    """Random prompt lengths (so tail pages are partial), some decode-side prefixes, random steps."""
    rng = np.random.default_rng([cfg.seed, 0x5EED])
    plans = []
    for i in range(cfg.rooms):
        tokens = int(rng.integers(cfg.min_tokens, cfg.max_tokens + 1))
        pages = math.ceil(tokens / PAGE_TOKENS)
        prefix = 0
        if pages > 1 and rng.random() < cfg.prefix_fraction:
            prefix = int(rng.integers(1, pages))  # at least one page still travels
        steps = int(rng.integers(cfg.min_steps, cfg.max_steps + 1))
        plans.append(RoomPlan(room=i + 1, prompt_tokens=tokens, prefix_pages=prefix, steps=steps))
    return tuple(plans)


@dataclass
class RoleEnv:
    """Environment overrides for each child: how the probe is switched on, as on a real pod."""

    common: dict[str, str] = field(default_factory=dict)
    prefill: dict[str, str] = field(default_factory=dict)
    decode: dict[str, str] = field(default_factory=dict)

    def for_role(self, role: str) -> dict[str, str]:
        return {**self.common, **getattr(self, role)}
