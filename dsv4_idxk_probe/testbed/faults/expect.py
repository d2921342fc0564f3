"""Which stage must first see a change, by the timing rules of docs/faults.md.

Decode digests a room at `decode_recv`, after every step that is a multiple
of the probe's step interval (`decode_step`), and at `decode_finish`. A change
to frozen bytes is first visible at the next of those points after it
happens; a change before the prefill digest, or to a prefill page that has
already left, is invisible by design.
"""

from __future__ import annotations


def next_digest_point(steps_done: int, steps: int, interval: int, batch: int) -> tuple[str, int | None]:
    """The first digest after a room has done `steps_done` of its `steps` decode steps,
    the last of them in decode batch `batch` (for a room just received: the batches
    done so far). Running rooms step once per batch; `decode_step` runs on every
    `interval`-th batch. The batch that produces a room's last token hands it to
    `decode_finish` instead.
    """
    if interval > 0:
        due = (batch // interval + 1) * interval
        step = steps_done + due - batch
        if step < steps:
            return "decode_step", step
    return "decode_finish", None


def first_stage(
    when: str, after_step: int, steps: int, interval: int, *, batch: int | None = None, page_in_last_write: bool = True
) -> tuple[str, int | None] | None:
    """Expected first stage of a change to frozen bytes; None when no stage can see it.
    `batch`: the decode batch of step `after_step` (default: a room received before batch 1)."""
    if when == "before_send":
        # After the prefill digest: only pages still to be sent carry the change to decode.
        return ("decode_recv", None) if page_in_last_write else None
    if when == "in_flight":
        return "decode_recv", None
    return next_digest_point(after_step, steps, interval, after_step if batch is None else batch)


def effect(room: int, layer_ids: list[int], page: int, segments: list[str], stage: tuple[str, int | None] | None) -> dict:
    """One expected finding: the cells that changed and where they must first show."""
    return {
        "room": room,
        "layers": sorted(layer_ids),
        "page": page,
        "segments": sorted(segments),
        "stage": stage[0] if stage and segments else None,
        "step": stage[1] if stage and segments else None,
    }
