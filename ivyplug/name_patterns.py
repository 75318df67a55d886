"""Name patterns of LAMB's exclusions, one rule for torch and Keras (framework-free: the Keras LAMB uses it).

Each pattern is a regular expression searched anywhere in the name (:func:`re.search`), so a plain word such as
``"bias"`` is a substring match, as Keras's own ``exclude_from_weight_decay(var_names=...)`` does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def check_patterns(name: str, patterns: Sequence[str] | None) -> tuple[str, ...]:
    """Validate a list of regular expressions (a lone string is refused: it would be read as characters)."""
    if patterns is None:
        return ()
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise ValueError(f"{name} must be a list of regular expressions (e.g. ['bias', 'norm']), got {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{name} must hold non-empty strings, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{name} holds an invalid regular expression {pattern!r}: {exc}") from None
    return tuple(patterns)


def matches_any(patterns: Sequence[str], name: str) -> bool:
    """Whether any pattern is found in ``name`` (:func:`re.search`; the Keras LAMB uses the same rule)."""
    return any(re.search(pattern, name) for pattern in patterns)
