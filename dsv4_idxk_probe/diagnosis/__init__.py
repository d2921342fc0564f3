"""Diagnosis: what a bad cell's bytes became, and which operation last touched its page.

Three parts, none of which knows SGLang (docs/diagnosis.md):

* `PageJournal`: a bounded ring of page events the hooks saw (allocated to a
  room, transfer landed, HiCache load or backup, freed), each with a
  monotonic time; O(1) per event on the serving thread, pages resolved only
  when a mismatch asks;
* `ContentIndex`: content digests (position-free) of the cells of the rooms a
  decode process holds and of the last occupant of the pages it freed,
  within a stated cell bound;
* `diagnose_cells`: per bad cell, one of `KINDS`, with the evidence.
"""

from .content import content_digests, zero_cell_digests
from .content_index import ContentIndex
from .diagnose import KINDS, CellDiagnosis, diagnose_cells, summarise
from .journal import EVENT_KINDS, PageJournal

__all__ = [
    "EVENT_KINDS", "KINDS", "CellDiagnosis", "ContentIndex", "PageJournal", "content_digests", "diagnose_cells",
    "summarise", "zero_cell_digests",
]
