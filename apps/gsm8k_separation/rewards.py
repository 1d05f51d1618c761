"""GSM8K rewards: answer extraction, exact numeric match, and the embedded profile's shaping.

Extraction follows the dataset's convention: the number after the last ``####`` when there
is one, else the last number in the text. Numbers may carry signs, thousands separators,
a currency sign and decimals; ``1,000``, ``$1000`` and ``1000.00`` all match ``1000``.

Shaped reward (embedded profile only, `SHAPED_MAX` at most, below any exact match): a tiny
random policy almost never states the right number, so every group would get the same
zero reward, a zero advantage and no gradient. For a group whose exact rewards are all
zero, each completion instead earns a third of `SHAPED_MAX` for each of: its share of
ASCII characters (readable text rather than random tokens of a 152k vocabulary), its share
of digit characters, and ``exp(-|predicted - gold| / max(1, |gold|))`` when it states a
number. The app announces this in its output and records the exact reward separately.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

ANSWER_MARK = "####"
SHAPED_MAX = 0.2
"""Upper bound of the shaped reward; an exact match earns `EXACT`."""
EXACT = 1.0
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def extract_answer(text: str) -> Decimal | None:
    """The stated final answer: the first number after the last ``####``, else the last number.

    Returns:
        The number, or None when the text states none.
    """
    head, mark, tail = text.rpartition(ANSWER_MARK)
    if mark:
        found = _NUMBER.findall(tail)
        if found:
            return _parse(found[0])
        text = head
    found = _NUMBER.findall(text)
    return _parse(found[-1]) if found else None


def _parse(token: str) -> Decimal | None:
    try:
        return Decimal(token.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None


def exact_reward(completion: str, gold: Decimal) -> float:
    """`EXACT` when the completion's answer equals `gold` numerically, else 0."""
    predicted = extract_answer(completion)
    return EXACT if predicted is not None and predicted == gold else 0.0


def shaped_reward(completion: str, gold: Decimal) -> float:
    """The embedded profile's dense signal in ``[0, SHAPED_MAX]`` (see the module doc)."""
    length = max(1, len(completion))
    ascii_share = sum(c.isascii() for c in completion) / length
    digits = sum(c.isdigit() for c in completion) / length
    predicted = extract_answer(completion)
    closeness = 0.0
    if predicted is not None:
        scale = max(Decimal(1), abs(gold))
        closeness = math.exp(-float(min(abs(predicted - gold) / scale, Decimal(50))))
    return SHAPED_MAX / 3 * (ascii_share + digits + closeness)


def group_rewards(completions: Sequence[str], golds: Sequence[Decimal], *, group_size: int,
                  shaped: bool) -> tuple[list[float], list[float]]:
    """Rewards of consecutive groups of `group_size` completions of the same problem.

    Args:
        completions: the decoded completions, group after group.
        golds: the gold answer of each completion.
        group_size: completions per problem.
        shaped: add `shaped_reward` to groups whose exact rewards are all zero.

    Returns:
        (rewards used for training, exact rewards).
    """
    if len(completions) != len(golds) or len(completions) % group_size:
        raise ValueError(f"{len(completions)} completions and {len(golds)} answers do not form "
                         f"groups of {group_size}")
    exact = [exact_reward(c, g) for c, g in zip(completions, golds, strict=True)]
    rewards = list(exact)
    for start in range(0, len(exact), group_size):
        group = range(start, start + group_size)
        if shaped and not any(exact[i] for i in group):
            for i in group:
                rewards[i] = shaped_reward(completions[i], golds[i])
    return rewards, exact
