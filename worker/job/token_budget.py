"""Refusing a text that cannot fit before rendering or tokenizing all of it.

A text (a prompt, or a chat as its template streams it out) is read piece by piece against two
lower bounds on its token count; the first that passes the limit stops the reading:

- characters: no token covers more characters than the vocabulary's longest token string, so
  ``chars`` characters make at least ``chars / longest`` tokens (divided by
  :data:`UNFITTABLE_MARGIN` again, for normalizers that drop or merge characters). Free, but loose
  for a vocabulary with a long token (a run of spaces, a long special token).
- a prefix: the first ``probe`` characters, tokenized alone, make as many tokens as they do inside
  the whole text, but for the word the cut falls in (pre-tokenizers split words apart before the
  model merges within them); :data:`CUT_MARGIN_TOKENS` is taken off for it. Probes start at
  :data:`PROBE_CHARS_PER_TOKEN` characters per token of the limit and double, so a text is
  tokenized at most about twice as far as it takes to hold the limit's tokens.

Invariant: a text under the limit is never refused (both bounds are below its true count); the
reading of one over it costs time and memory bounded by the limit, not by the text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: A text is refused unread when even this many times the longest token per token leaves it over the limit.
UNFITTABLE_MARGIN = 2
#: Tokens a prefix may count that the whole text splits otherwise (the cut's word).
CUT_MARGIN_TOKENS = 64
#: The first probe's length, in characters per token of the limit (English runs at about 4).
PROBE_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Overflow:
    """Where a text was found over the limit: ``chars`` characters read, at least ``fewest``
    tokens, found ``by_prefix`` (tokenized) or by characters alone."""

    chars: int
    fewest: int
    by_prefix: bool


def first_probe_chars(limit: int) -> int:
    """The first prefix tokenized alone, in characters: below it a text is tokenized whole."""
    return PROBE_CHARS_PER_TOKEN * (limit + CUT_MARGIN_TOKENS)


def fewest_by_chars(chars: int, longest_token_chars: int) -> int:
    """The fewest tokens ``chars`` characters can make, by the characters bound."""
    return chars // max(1, UNFITTABLE_MARGIN * longest_token_chars)


def first_overflow(pieces: Iterable[str], limit: int, longest_token_chars: int,
                   count_tokens: Callable[[str], int], probe_chars_per_token: int = PROBE_CHARS_PER_TOKEN
                   ) -> Overflow | None:
    """The first point at which the text ``pieces`` make is surely over ``limit`` tokens, reading
    no further; None when the whole text was read without that (it may still be over by a little:
    the caller tokenizes it whole)."""
    seen: list[str] = []
    chars = 0
    probe = probe_chars_per_token * (limit + CUT_MARGIN_TOKENS)
    for piece in pieces:
        seen.append(piece)
        chars += len(piece)
        if (fewest := fewest_by_chars(chars, longest_token_chars)) > limit:
            return Overflow(chars, fewest, by_prefix=False)
        while chars >= probe:
            text = "".join(seen)
            seen = [text]
            fewest = count_tokens(text[:probe]) - CUT_MARGIN_TOKENS
            if fewest > limit:
                return Overflow(probe, fewest, by_prefix=True)
            probe *= 2
    return None


def longest_token_chars(tokenizer: Any) -> int:
    """Length of the vocabulary's longest token string, 0 without a tokenizer. Token strings
    spell bytes (byte-level BPE) or add markers (``▁``, ``##``), so no token covers more
    characters of text than this."""
    return 0 if tokenizer is None else max((len(token) for token in tokenizer.get_vocab()), default=0)
