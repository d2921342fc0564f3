"""A small host module for the patcher tests: it stands in for an SGLang
module (classes with methods the probe wraps) and holds the wrapper factories
the test target tables name. Plain Python, so patch/unpatch cycles are fast."""

from __future__ import annotations

calls: list = []


class Host:
    def add(self, x, y=1):
        return x + y

    def scale(self, x, factor=2):
        return x * factor

    def negate(self, x):
        calls.append(("negate", x))
        return -x

    def explode(self, x):
        raise ValueError(f"host failure {x}")

    def square(self, x):
        return x * x


def make_counting_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        calls.append((type(instance).__name__, args))
        return wrapped(*args, **kwargs)

    return wrapper


def make_raise_before_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        raise RuntimeError("probe bug before the call")

    return wrapper


def make_raise_after_wrapper(runtime):
    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        raise RuntimeError("probe bug after the call")

    return wrapper


def make_broken_factory(runtime):
    raise RuntimeError("factory bug")
