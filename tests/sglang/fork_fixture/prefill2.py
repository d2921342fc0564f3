"""A fork's module layout: SGLang 0.5.23's prefill classes under another module name."""

from sglang.srt.disaggregation.prefill import *  # noqa: F401,F403
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin  # noqa: F401
