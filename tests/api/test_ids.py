"""Object ids and API keys: format, alphabet and uniformity of the random part."""

from __future__ import annotations

import re
import string
from collections import Counter

from control.ids import _random, key_prefix, new_api_key, new_id

ALPHABET = string.ascii_letters + string.digits


def test_ids_and_keys_have_their_documented_shape():
    assert re.fullmatch(r"ftevent-[A-Za-z0-9]{24}", new_id("ftevent"))
    key, prefix = new_api_key()
    assert re.fullmatch(r"tf_[A-Za-z0-9]{8}_[A-Za-z0-9]{32}", key) and key_prefix(key) == prefix
    assert len({new_id("x") for _ in range(10_000)}) == 10_000


def test_random_characters_are_uniform_over_the_alphabet():
    """Chi-square over the 62 symbols (61 degrees of freedom): above 125.5 has probability
    1e-6 for a uniform source. The plain modulo of a byte, without rejection, would draw
    the first 8 symbols 5/4 as often as the others (statistic ~1,800 at this size)."""
    n = 62 * 4_000
    counts = Counter("".join(_random(1_000) for _ in range(n // 1_000)))
    assert set(counts) == set(ALPHABET)
    expected = n / len(ALPHABET)
    chi2 = sum((counts[c] - expected) ** 2 / expected for c in ALPHABET)
    assert chi2 < 125.5, chi2
