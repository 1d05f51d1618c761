"""GSM8K problems: a local jsonl file, the hub dataset when reachable, or a built-in generator.

Every source yields `Problem`s with the question and the gold answer as a number. The
built-in generator writes short multi-step word problems in GSM8K's answer style
(``<reasoning>\\n#### <number>``), so the default run needs no files and no network.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import socket
from collections.abc import Callable
from decimal import Decimal

import attrs

from .rewards import extract_answer

log = logging.getLogger(__name__)

HUB_DATASET = "openai/gsm8k"
HUB_HOST = ("huggingface.co", 443)
HUB_TIMEOUT_S = 2.0
GENERATED = "generated"


class DataError(ValueError):
    """A data record the job cannot use: ``<where>: <problem>`` (``where`` is ``file:line``)."""

    def __init__(self, *, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")


@attrs.frozen(kw_only=True)
class Problem:
    """One question and its gold numeric answer."""

    question: str
    answer: Decimal
    solution: str = ""
    """The reference solution text, when the source has one."""

    def prompt(self) -> str:
        """The text the policy continues."""
        return f"Question: {self.question}\nAnswer:"


def from_record(record: dict, *, where: str) -> Problem:
    """A `Problem` from a GSM8K record (``question``, ``answer`` ending in ``#### n``).

    Raises:
        DataError: a field is missing or the answer states no number.
    """
    try:
        question, solution = record["question"], record["answer"]
    except (KeyError, TypeError):
        raise DataError(where=where, problem=f"expected an object with 'question' and "
                                             f"'answer', got {str(record)[:80]!r}") from None
    answer = extract_answer(str(solution))
    if answer is None:
        raise DataError(where=where,
                        problem=f"answer states no number: {str(solution)[-80:]!r}")
    return Problem(question=str(question), answer=answer, solution=str(solution))


def load_jsonl(path: str | os.PathLike) -> list[Problem]:
    """Every record of a GSM8K-format jsonl file (blank lines skipped).

    Raises:
        DataError: a line is not JSON or not a GSM8K record, or the file has none.
        OSError: the file cannot be read.
    """
    problems = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(where=f"{path}:{number}",
                                problem=f"not JSON ({exc.msg} at column {exc.colno})") from None
            problems.append(from_record(record, where=f"{path}:{number}"))
    if not problems:
        raise DataError(where=str(path), problem="no problems (the file is empty)")
    return problems


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set or the hub does not answer within `HUB_TIMEOUT_S`."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    try:
        socket.create_connection(HUB_HOST, timeout=HUB_TIMEOUT_S).close()
    except OSError:
        return True
    return False


def load_hub(split: str = "train") -> list[Problem] | None:
    """`HUB_DATASET` through ``datasets`` when it is installed and the hub answers, else None."""
    if importlib.util.find_spec("datasets") is None or hub_offline():
        return None
    try:
        import datasets  # noqa: PLC0415 - optional, only when reachable

        rows = datasets.load_dataset(HUB_DATASET, "main", split=split)
        return [from_record(row, where=f"{HUB_DATASET}[{i}]") for i, row in enumerate(rows)]
    except Exception as exc:  # noqa: BLE001 - any failure means: use the offline source
        log.info("%s not available (%s); using the built-in generator", HUB_DATASET, exc)
        return None


def generate(count: int, *, seed: int) -> list[Problem]:
    """`count` GSM8K-style two- or three-step word problems with exact integer answers."""
    rng = random.Random(seed)
    return [rng.choice(_TEMPLATES)(rng) for _ in range(count)]


def load_problems(data: str | None, *, seed: int, count: int = 512) -> tuple[list[Problem], str]:
    """The problems of a run and where they came from.

    Args:
        data: a jsonl path; None: the hub dataset when reachable, else the generator.
        seed: the generator's seed.
        count: how many problems the generator makes.
    """
    if data is not None:
        return load_jsonl(data), str(data)
    hub = load_hub()
    if hub is not None:
        return hub, HUB_DATASET
    return generate(count, seed=seed), f"{GENERATED} ({count} GSM8K-style problems, seed {seed})"


def _solved(question: str, steps: list[str], answer: int) -> Problem:
    solution = "\n".join(steps) + f"\n#### {answer}"
    return Problem(question=question, answer=Decimal(answer), solution=solution)


def _sold(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(["clips", "cookies", "stickers", "pencils"])
    first, factor = rng.randint(2, 60) * 2, rng.choice([2, 3, 4])
    second = first * factor
    return _solved(f"{name} sold {first} {item} in April and {factor} times as many in May. "
                   f"How many {item} did {name} sell in April and May?",
                   [f"In May {name} sold {first}*{factor} = {second} {item}.",
                    f"Altogether {first}+{second} = {first + second}."], first + second)


def _wage(rng: random.Random) -> Problem:
    name, rate, hours = rng.choice(_NAMES), rng.randint(8, 30), rng.randint(2, 9)
    spent = rng.randint(1, rate * hours - 1)
    earned = rate * hours
    return _solved(f"{name} earns ${rate} an hour and works {hours} hours. {name} then spends "
                   f"${spent} on groceries. How many dollars does {name} have left?",
                   [f"{name} earns {rate}*{hours} = {earned} dollars.",
                    f"After shopping {earned}-{spent} = {earned - spent} dollars are left."],
                   earned - spent)


def _shelves(rng: random.Random) -> Problem:
    shelves, per, removed = rng.randint(3, 12), rng.randint(5, 40), rng.randint(1, 4)
    total = shelves * per
    left = total - removed * per
    return _solved(f"A library has {shelves} shelves with {per} books on each shelf. It removes "
                   f"{removed} full shelves of books. How many books are left?",
                   [f"There are {shelves}*{per} = {total} books.",
                    f"{removed}*{per} = {removed * per} are removed, so {total}-{removed * per} "
                    f"= {left} are left."], left)


def _share(rng: random.Random) -> Problem:
    friends, each, extra = rng.randint(2, 9), rng.randint(3, 25), rng.randint(1, 20)
    total = friends * each + extra
    return _solved(f"{rng.choice(_NAMES)} has {total} marbles, gives {each} to each of "
                   f"{friends} friends and keeps the rest. How many marbles are kept?",
                   [f"{friends}*{each} = {friends * each} marbles are given away.",
                    f"{total}-{friends * each} = {extra} are kept."], extra)


_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Ken", "Alexis", "Tina"]
_TEMPLATES: list[Callable[[random.Random], Problem]] = [_sold, _wage, _shelves, _share]
