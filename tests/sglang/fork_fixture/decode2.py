"""A fork's module layout: SGLang 0.5.23's decode classes under another module name."""

from sglang.srt.disaggregation.decode import *  # noqa: F401,F403
from sglang.srt.disaggregation.decode import (  # noqa: F401
    DecodePreallocQueue,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
