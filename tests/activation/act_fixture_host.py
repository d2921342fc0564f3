"""A small host module for the activation tests (stands in for an SGLang module)."""

from __future__ import annotations

calls: list = []


class Engine:
    def step(self, x):
        return x + 1


def make_counting_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    return wrapper
