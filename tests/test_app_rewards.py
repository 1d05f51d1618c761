"""GSM8K answer extraction, exact match and the embedded profile's shaped reward."""

from __future__ import annotations

from decimal import Decimal

import pytest


from gsm8k_separation.data import Problem, from_record, generate
from gsm8k_separation.rewards import (
    EXACT,
    SHAPED_MAX,
    exact_reward,
    extract_answer,
    group_rewards,
    shaped_reward,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", Decimal(72)),
    ("so 3 + 4 = 7 #### 1,000", Decimal(1000)),
    ("#### $18.50", Decimal("18.50")),
    ("#### -5", Decimal(-5)),
    ("I think 12 apples, then 15", Decimal(15)),
    ("#### 3\nlater #### 9 and 10", Decimal(9)),
    ("#### none\nthe answer is 4", Decimal(4)),
    ("no numbers at all", None),
])
def test_extract_answer(text, expected):
    """The number after the last ####, else the last number; separators and $ ignored."""
    assert expected == extract_answer(text)


def test_exact_reward_is_numeric():
    """1000.00, 1,000 and $1000 all match 1000; 999 does not."""
    gold = Decimal(1000)
    assert [EXACT, EXACT, EXACT, 0.0] == [exact_reward(t, gold) for t in
                                          ("#### 1000.00", "#### 1,000", "it is $1000", "999")]


def test_shaped_reward_bounds_and_order():
    """Shaped rewards stay in [0, SHAPED_MAX] and prefer a close number to a far one."""
    gold = Decimal(72)
    close, far, noise = (shaped_reward(t, gold) for t in ("#### 71", "#### 7000", "猫犬鳥"))
    assert 0.0 == noise
    assert 0 < far < close <= SHAPED_MAX


def test_group_rewards_shape_only_groups_without_exact_answers():
    """A group with an exact answer keeps exact rewards; an all-zero group gets shaping."""
    texts = ["#### 5", "nope", "#### 4", "x"]
    golds = [Decimal(5), Decimal(5), Decimal(9), Decimal(9)]
    rewards, exact = group_rewards(texts, golds, group_size=2, shaped=True)
    assert [EXACT, 0.0, 0.0, 0.0] == exact
    assert [EXACT, 0.0] == rewards[:2]
    assert all(0 < r <= SHAPED_MAX for r in rewards[2:])
    assert (exact, exact) == group_rewards(texts, golds, group_size=2, shaped=False)


def test_group_rewards_rejects_partial_groups():
    """Completions that do not form whole groups are an error."""
    with pytest.raises(ValueError, match="do not form groups of 2"):
        group_rewards(["a", "b", "c"], [Decimal(1)] * 3, group_size=2, shaped=False)


def test_gsm8k_record_and_generator():
    """A GSM8K record parses; generated problems' solutions state their answers."""
    problem = from_record({"question": "q?", "answer": "2+2=4\n#### 4"}, where="t")
    assert Problem(question="q?", answer=Decimal(4), solution="2+2=4\n#### 4") == problem
    for made in generate(50, seed=3):
        assert made.answer == extract_answer(made.solution)
    assert generate(5, seed=1) == generate(5, seed=1)
