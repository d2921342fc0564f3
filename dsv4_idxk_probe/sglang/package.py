"""The SGLang releases the shipped target tables were tested against (each in CI)."""

_instruments = ("sglang >= 0.5.18, < 0.5.24",)
