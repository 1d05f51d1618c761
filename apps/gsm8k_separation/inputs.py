"""Startup checks of the command line's inputs: ``--out``, ``--model`` and ``--data``.

Each runs before any worker starts, imports no torch, and turns an ordinary mistake into one
`InputError` that names the input, what was wrong and the fix; the CLI prints it as one
line and exits 2. Nothing is written into ``--out`` until every check has passed
(`claim_out`).
"""

from __future__ import annotations

import fcntl
import re
import shutil
from pathlib import Path
from typing import IO

from .data import DataError, Problem, hub_offline, load_problems

LOCK_FILE = ".gsm8k-run.lock"
"""Held (flock) by the job writing into an ``--out`` folder, for the job's lifetime."""
RUN_FILES = ("metrics.jsonl", "sync.png", "store", "reference-store", "checkpoint")
"""What a run leaves in its ``--out`` folder; any of them marks an earlier run."""
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: what a Hugging Face hub id looks like."""
DATA_FIX = ("give a GSM8K jsonl file (one {\"question\": ..., \"answer\": \"... #### n\"} "
            "object per line), or leave --data out for the built-in problems")
MODEL_FIX = ("give a local checkpoint folder (what save_pretrained writes: config.json and "
             "the weights), or leave --model out for the tiny random Qwen3")


class InputError(ValueError):
    """A command-line input the job cannot use: ``<input>: <problem>; fix: <fix>``."""

    def __init__(self, *, name: str, problem: str, fix: str) -> None:
        self.name = name
        self.problem = problem
        self.fix = fix
        super().__init__(f"{name}: {problem}; fix: {fix}")


def check_out(out: Path, *, overwrite: bool, resume: Path | None) -> None:
    """Refuse an ``--out`` that is a file, that another job writes into, or that holds an
    earlier run (unless `overwrite`, or `resume` names the same folder). Writes nothing.

    Raises:
        InputError: naming ``--out`` and the fix.
    """
    name = f"--out {out}"
    if out.exists() and not out.is_dir():
        raise InputError(name=name, problem="is a file, not a folder",
                         fix="name a folder (it is created when missing)")
    if not out.is_dir():
        return
    lock = out / LOCK_FILE
    if lock.is_file():
        with open(lock, "rb") as handle:
            if not _try_lock(handle):
                raise InputError(name=name, problem="another job is writing into this folder",
                                 fix="wait for it to end, or give another --out folder")
    earlier = sorted(f for f in RUN_FILES if (out / f).exists())
    resuming = resume is not None and resume.resolve() == out.resolve()
    if earlier and not (overwrite or resuming):
        raise InputError(name=name, problem=f"holds an earlier run ({', '.join(earlier)})",
                         fix="add --overwrite to replace it, or give another --out folder")


def claim_out(out: Path, *, overwrite: bool) -> IO[bytes]:
    """Create `out`, take its run lock and, with `overwrite`, remove the earlier run's files.

    Returns:
        The open lock file; the lock holds until it is closed or the process ends.

    Raises:
        InputError: another job took the folder since `check_out`.
    """
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK_FILE, "a+b")  # noqa: SIM115 - held for the run's lifetime
    if not _try_lock(handle):
        handle.close()
        raise InputError(name=f"--out {out}", problem="another job is writing into this folder",
                         fix="wait for it to end, or give another --out folder")
    if overwrite:
        for name in RUN_FILES:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    return handle


def _try_lock(handle: IO[bytes]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def check_model(model: str | None) -> str | None:
    """The checkpoint the workers load: `model` as given, or the local folder of a hub id
    found in the Hugging Face cache. Never waits on the network: a hub id that is not
    cached needs the hub to answer a 2 s probe (and ``HF_HUB_OFFLINE`` unset).

    Raises:
        InputError: no such folder, a folder without config.json or weights, or a hub id
            that is neither cached nor reachable.
    """
    if model is None:
        return None
    name = f"--model {model}"
    path = Path(model).expanduser()
    if path.is_dir():
        _check_checkpoint(path, name=name)
        return str(path)
    if path.exists():
        raise InputError(name=name, problem="is a file, not a checkpoint folder", fix=MODEL_FIX)
    if not HUB_ID.match(model):
        raise InputError(name=name, problem="no such folder", fix=MODEL_FIX)
    cached = _cached_snapshot(model)
    if cached is not None:
        _check_checkpoint(cached, name=name)
        return str(cached)
    if hub_offline():
        raise InputError(name=name, problem="no such folder, and as a Hugging Face hub id it is "
                                            "not in the local cache and the hub is unreachable "
                                            "(offline)",
                         fix=f"download it where the hub answers (huggingface-cli download "
                             f"{model}), or {MODEL_FIX}")
    return model


def _check_checkpoint(folder: Path, *, name: str) -> None:
    if not (folder / "config.json").is_file():
        raise InputError(name=name, problem=f"{folder} holds no config.json (not a Hugging "
                                            f"Face checkpoint)", fix=MODEL_FIX)
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise InputError(name=name, problem=f"{folder} holds no weights "
                                            f"({' or '.join(WEIGHT_PATTERNS)})", fix=MODEL_FIX)


def _cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of `repo_id` that has a config.json, or None."""
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - only for hub ids

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def check_data(data: str | None, *, seed: int) -> tuple[list[Problem], str]:
    """`load_problems`, with a missing or malformed ``--data`` file as an `InputError`."""
    try:
        return load_problems(data, seed=seed)
    except DataError as exc:
        raise InputError(name=f"--data {exc.where}", problem=exc.problem, fix=DATA_FIX) from exc
    except FileNotFoundError as exc:
        raise InputError(name=f"--data {data}", problem="no such file", fix=DATA_FIX) from exc
    except IsADirectoryError as exc:
        raise InputError(name=f"--data {data}", problem="is a folder, not a file",
                         fix=DATA_FIX) from exc
    except (PermissionError, UnicodeDecodeError) as exc:
        raise InputError(name=f"--data {data}", problem=f"cannot be read ({exc})",
                         fix=DATA_FIX) from exc

