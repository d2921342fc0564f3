"""The SGLang releases the shipped target tables were tested against."""

_instruments = ("sglang >= 0.5.23, < 0.5.24",)
