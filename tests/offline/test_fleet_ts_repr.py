"""The native pass's proof that a 16-17 digit `ts` is Python's `repr` of its value
(`cscan.c`, `repr_proof`: exact integer arithmetic, no dtoa), against `repr` itself on
millions of spellings: every double's repr and its 16- and 17-digit `%g` spellings, random
digit strings (mostly not repr), the decimals on either side of a double at 16 and 17 digits,
ties between two 17-digit decimals, powers of two (a narrower interval below) and of ten,
mantissas across 2^53 and 10^16, and the grammar's ends (1e-4, 11 integer digits)."""

from __future__ import annotations

import math
import random
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import numpy as np
import pytest

from dsv4_idxk_probe.offline.fleet import native


def cscan():
    if native.cscan is None:
        pytest.fail("the native line pass is not built")
    return native.cscan


def verdicts(texts: list[str]) -> tuple[list[int], list[float]]:
    status, values = cscan().ts_spellings("\n".join(texts).encode())
    return np.frombuffer(status, np.uint8).tolist(), np.frombuffer(values, np.float64).tolist()


def in_grammar(text: str) -> bool:
    """What the split's `ts` grammar admits before the spelling rule: fixed notation, at most 11
    integer digits (no leading zero), 1-20 fraction digits."""
    whole, _, frac = text.partition(".")
    return ("e" not in text and whole.isdigit() and len(whole) <= 11 and (whole == "0" or whole[0] != "0")
            and frac.isdigit() and 1 <= len(frac) <= 20)


def significant(text: str) -> int:
    return len(text.replace(".", "").lstrip("0"))


def assert_as_repr(texts: list[str], *, proven_share: float = 1.0) -> tuple[int, int]:
    """Each text is accepted (status 1, value float(text)) iff repr(float(text)) == text; the
    16-17 digit ones are decided by the proof (never left to Python). Returns (accepted,
    refused) among the 16-17 digit texts."""
    texts = [t for t in texts if in_grammar(t)]
    status, values = verdicts(texts)
    accepted = refused = 0
    wrong = []
    for text, s, v in zip(texts, status, values):
        long = significant(text) >= 16
        assert not (long and s == 2), f"{text}: left to Python's check, not proven"
        want = repr(float(text)) == text
        if (s == 1) != want or (s == 1 and v != float(text)):
            wrong.append((text, s, v, repr(float(text))))
        if long and significant(text) <= 17:
            accepted += s == 1
            refused += s == 0
    assert not wrong, f"{len(wrong)} wrong, e.g. {wrong[:5]}"
    return accepted, refused


def g_spellings(x: float, digits: int) -> str:
    return "%.*g" % (digits, x)  # fixed notation with trailing zeros dropped for 1e-4 <= x < 1e11


def neighbours(x: float) -> list[str]:
    """The decimals of 16 and 17 significant digits on either side of x (floor and ceiling of
    its exact value), in fixed notation without trailing zeros: the candidates dtoa weighs."""
    d = Decimal(x)
    out = []
    for digits in (16, 17):
        unit = Decimal(1).scaleb(d.adjusted() - digits + 1)
        for rounding in (ROUND_FLOOR, ROUND_CEILING):
            q = d.quantize(unit, rounding=rounding)
            for delta in (-1, 0, 1):
                text = format(q + delta * unit, "f")
                if "." in text:
                    text = text.rstrip("0")
                    out.append(text + "0" if text.endswith(".") else text)
    return out


def test_every_double_spelled_by_repr_and_by_g_is_judged_as_repr_judges_it():
    """700,000 doubles over the grammar's range (log-uniform, and ts-like around 1.7e9):
    repr(x) is accepted with value x; %.17g and %.16g spellings are accepted exactly when they
    are repr(x)."""
    rng = np.random.default_rng(34)
    xs = np.concatenate([10 ** rng.uniform(-4, 11, 500_000), 1.7e9 + rng.uniform(0, 1e7, 200_000)]).tolist()
    reprs = [repr(x) for x in xs]
    status, values = verdicts(reprs)
    assert status == [1] * len(xs)
    assert values == xs
    seventeen = ["%.17g" % x for x in xs]
    accepted, refused = assert_as_repr(seventeen)
    assert accepted > 100_000 and refused > 100_000  # both outcomes are common at 17 digits
    accepted, refused = assert_as_repr(["%.16g" % x for x in xs[:300_000]])
    assert accepted > 10_000 and refused > 1_000  # a 16-digit %g spelling is mostly repr


def test_random_digit_strings_are_accepted_only_when_repr():
    """16-17 random significant digits with the dot anywhere the grammar allows: most are not
    the shortest spelling of their double."""
    rng = random.Random(3434)
    texts = []
    for _ in range(400_000):
        n = rng.choice((16, 17))
        digits = str(rng.randrange(10 ** (n - 1), 10 ** n))
        if digits.endswith("0"):
            digits = digits[:-1] + str(rng.randrange(1, 10))
        point = rng.randrange(-3, 12)  # integer digits; < 1: leading zeros after the dot
        texts.append("0." + "0" * -point + digits if point <= 0 else digits[:point] + "." + digits[point:])
    accepted, refused = assert_as_repr(texts)
    assert accepted > 1_000 and refused > 100_000


def test_the_decimals_next_to_a_double_at_16_and_17_digits():
    """Floor and ceiling of each double's exact value at 16 and 17 digits, and their neighbours:
    the candidates whose distance to x (and the interval's bounds) decide repr."""
    rng = np.random.default_rng(7)
    xs = np.concatenate([10 ** rng.uniform(-4, 11, 20_000), 1.7e9 + rng.uniform(0, 1e7, 5_000)]).tolist()
    texts = [t for x in xs for t in neighbours(x)]
    accepted, refused = assert_as_repr(texts)
    assert accepted > 10_000 and refused > 50_000


def test_ties_between_two_17_digit_decimals_go_to_the_even_digit():
    """x = a + b / 2^t with 18 exact significant digits ending in 5: x is exactly halfway
    between two 17-digit decimals, both in its interval; repr takes the even last digit."""
    rng = random.Random(5)
    xs = []
    for _ in range(20_000):
        int_digits = rng.randrange(1, 12)
        t = 18 - int_digits
        a = rng.randrange(10 ** (int_digits - 1), 10 ** int_digits)
        b = rng.randrange(1, 1 << t, 2)
        x = a + b / 2 ** t
        if x == (a * 2 ** t + b) / 2 ** t and a * 2 ** t + b < 2 ** 53:
            xs.append(x)
    texts = [t for x in xs for t in neighbours(x)]
    ties = [x for x in xs if len(format(Decimal(x), "f").replace(".", "").lstrip("0")) == 18]
    assert len(ties) > 5_000
    odd_refused = [t for x in ties for t in neighbours(x)]
    assert_as_repr(texts)
    assert_as_repr(odd_refused)
    # the tie itself: 1700000000 + 1/256 between ...0039062 and ...0039063
    assert verdicts(["1700000000.0039062", "1700000000.0039063"])[0] == [1, 0]
    assert repr(1700000000.00390625) == "1700000000.0039062"


def test_powers_of_two_and_ten_and_their_neighbours():
    """At a power of two the interval below is half as wide as above; at powers of ten the
    digit count changes."""
    xs = []
    for base in [2.0 ** e for e in range(-13, 37)] + [10.0 ** e for e in range(-4, 11)]:
        x = base
        for _ in range(4):
            x = math.nextafter(x, 0)
        for _ in range(9):
            xs.append(x)
            x = math.nextafter(x, math.inf)
    texts = [t for x in xs for t in neighbours(x)] + [repr(x) for x in xs]
    accepted, refused = assert_as_repr(texts)
    assert accepted > 50 and refused > 500


def test_mantissas_across_2_to_the_53_and_powers_of_ten():
    """(double)M rounds once M passes 2^53: the first guess is off, the proof corrects it."""
    rng = random.Random(53)
    texts = []
    for m in [*range(2 ** 53 - 300, 2 ** 53 + 300), *range(10 ** 16 - 300, 10 ** 16 + 300),
              *range(10 ** 17 - 600, 10 ** 17), *(rng.randrange(2 ** 53, 10 ** 17) for _ in range(5_000))]:
        digits = str(m)
        if digits.endswith("0"):
            continue
        for point in range(-3, 12):
            texts.append("0." + "0" * -point + digits if point <= 0 else digits[:point] + "." + digits[point:])
    accepted, refused = assert_as_repr(texts)
    assert refused > 10_000 and accepted > 100


def test_the_grammars_ends():
    """The smallest and largest ts the grammar admits; a spelling below 1e-4 or past 17 digits
    (subnormals and all) is never the writer's."""
    ends = ["0.0001", "0.00010000000000000001", "0.0001000000000000001", "0.00010000000000000002",
            "0.00009999999999999999", repr(math.nextafter(1e-4, 1)), repr(math.nextafter(1e11, 0)),
            "99999999999.999999", "99999999999.99999", "99999999999.9999847", "1.7976931348623157",
            "0.1234567890123456789", "123.45678901234567891"]
    assert_as_repr(ends)
    status, _ = verdicts(["0.00009999999999999999", "0.0000000000000000001", "1.00000000000000000001"])
    assert status == [0, 0, 0]
