"""The embedded job: an actor process and a rollout process, driven step by step.

Per step: the rollout samples a batch of groups with the weights it holds (version v) and
scores them; the actor takes exactly one GRPO/AdamW step on it and syncs version v + 1
through the staged-file store; the rollout applies it and, with weight digests on, sends
its digests, which the actor compares with its own bf16 copy. Version 1 is the first,
full sync of the initial weights. A run resumed from a checkpoint of version V starts by
syncing V in full to the new rollout process, then steps on from there.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import queue
import shutil
import signal
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from . import checkpoint, metrics, table
from .actor import ActorWorker
from .data import Problem
from .experiment import Profile
from .rewards import SHAPED_MAX
from .rollout import RolloutWorker
from .spec import JobSpec, job_spec
from .worker import CLOSE, ERROR, Interrupted, WorkerError, serve

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 600.0
POLL_S = 1.0
STORE = "store"
REFERENCE_STORE = "reference-store"
TINY_MODEL = "tiny random Qwen3"
"""The model's name in the plot's title when no ``--model`` is given."""
DIAGNOSTIC_SEED = 7_919
"""Seed of the deterministic rollout diagnostics' sampling (any fixed value)."""


@attrs.define
class _Worker:
    name: str
    process: Any
    inbox: Any
    outbox: Any

    def call(self, method: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        self.inbox.put((method, kwargs))
        return self.answer(timeout)

    def answer(self, timeout: float) -> Any:
        waited = 0.0
        while True:
            try:
                status, value = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                if not self.process.is_alive():
                    raise WorkerError(f"{self.name} process died "
                                      f"(exit code {self.process.exitcode})") from None
                if waited >= timeout:
                    raise WorkerError(f"{self.name}: no answer in {timeout:.0f} s") from None
                continue
            if status == ERROR:
                raise WorkerError(f"{self.name} process failed:\n{value}")
            return value


def _start(context: Any, name: str, handler: type, spec: Any) -> _Worker:
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=serve, args=(handler, spec, inbox, outbox), name=name,
                              daemon=True)
    # The child inherits an ignored SIGINT through exec, so a Ctrl-C while it imports does
    # not print its traceback; serve() keeps ignoring it.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    return _Worker(name, process, inbox, outbox)


def run(profile: Profile, problems: Sequence[Problem], *, steps: int, out: Path | None,
        model: str | None, resume: Path | None = None,
        say: Callable[[str], None] = tqdm.write,
        progress: bool = True) -> list[dict[str, Any]]:
    """Run GRPO up to `steps` optimizer steps and return one metrics record per sync
    (``steps + 1`` syncs; from a `resume` checkpoint, its version up to ``steps + 1``).

    Writes ``metrics.jsonl`` (a line per finished sync, as it finishes) and ``sync.png``
    into `out` when given; the stores live in `out` then, else in a temporary directory
    removed afterwards. With recovery on the actor's checkpoint goes to ``out/checkpoint``.

    Raises:
        Interrupted: KeyboardInterrupt (Ctrl-C, or SIGTERM through the CLI) stopped the
            job; the workers are stopped and the files written for the finished syncs.
        WorkerError: a worker raised or died.
    """
    interrupted = False
    scratch = None if out is not None else Path(tempfile.mkdtemp(prefix="gsm8k-dte-"))
    root = out if out is not None else scratch
    for name in (STORE, REFERENCE_STORE):
        if (root / name).exists():  # a new stream: old versions mean nothing to it
            shutil.rmtree(root / name)
    diagnostics = profile.run.delta.weight_update_delta_diagnostics
    spec = job_spec(profile, store=root / STORE, model=model, resume=resume,
                    reference_store=root / REFERENCE_STORE
                    if diagnostics.deterministic_rollout else None,
                    checkpoint=root / checkpoint.FOLDER if diagnostics.recovery else None)
    if out is not None:
        metrics.start_jsonl(out)
    records: list[dict[str, Any]] = []
    context = mp.get_context("spawn")
    workers = [_start(context, "actor", ActorWorker, spec),
               _start(context, "rollout", RolloutWorker, spec)]
    try:
        for worker in workers:
            worker.answer(START_TIMEOUT_S)
        _loop(profile, spec, problems, workers, records, steps=steps, say=say,
              progress=progress, out=out)
        for worker in workers:
            worker.call(CLOSE)
    except KeyboardInterrupt:
        for worker in workers:
            worker.process.terminate()
        interrupted = True
    except BaseException:
        for worker in workers:  # a failed step: nothing more will be asked of them
            worker.process.terminate()
        raise
    finally:
        for worker in workers:
            worker.process.join(timeout=10)
            if worker.process.is_alive():
                worker.process.terminate()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if out is not None and records:
        method = profile.run.delta.weight_update_delta_method.value \
            if profile.run.delta.enable_delta_weight_update else metrics.DENSE_METHOD
        metrics.plot(records, out, heading=metrics.title(
            model=model or TINY_MODEL, method=method, run=out.resolve().name,
            when=datetime.datetime.now().astimezone()))
    if interrupted:
        raise Interrupted(records)
    return records


def _loop(profile: Profile, spec: JobSpec, problems: Sequence[Problem], workers: list[_Worker],
          records: list[dict[str, Any]], *, steps: int, say: Callable[[str], None],
          progress: bool, out: Path | None) -> None:
    """Step and sync, appending each finished sync's record to `records` (and to
    ``out/metrics.jsonl``)."""
    actor, rollout = workers
    batch_size = spec.sampling.prompts_per_step
    described = actor.call("describe")
    say(f"policy: {described['params']:,} parameters, {described['dense_bytes']:,} B in bf16")
    first = described["steps"]
    if described["version"]:
        say(f"resumed: version {described['version']} after {first} steps; the first sync "
            f"gives the new rollout process that version in full")
    delta = profile.run.delta
    announced = False
    bar = tqdm(total=steps + 1 - first, desc="syncs", unit="sync", disable=not progress,
               leave=False)
    say(table.header())
    train = None
    probe = [p.prompt() for p in problems[:batch_size]]
    for step in range(first, steps + 1):
        if step > first:
            chosen = [problems[((step - 1) * batch_size + i) % len(problems)]
                      for i in range(batch_size)]
            batch = rollout.call("generate", prompts=[p.prompt() for p in chosen],
                                 answers=[str(p.answer) for p in chosen],
                                 seed=spec.seed * 100_003 + step)
            if spec.shaped_reward and not announced and batch["rewards"] != batch["exact"]:
                say(f"note: no exact answers in some groups; the embedded profile adds the "
                    f"shaped reward there (ASCII share, digit share, numeric closeness; "
                    f"<= {SHAPED_MAX}; "
                    f"see rewards.py). Switch off: embedded.shaped_reward=false")
                announced = True
            stats = actor.call("train", sequences=batch["sequences"],
                               attention=batch["attention"], prompt_len=batch["prompt_len"],
                               rewards=batch["rewards"])
            train = {**stats, "rewards": batch["rewards"], "exact": batch["exact"]}
        record = _sync(actor, rollout, version=step + 1, step=step, delta=delta, train=train)
        if delta.weight_update_delta_diagnostics.deterministic_rollout:
            diagnosis = rollout.call("diagnose", prompts=probe, seed=DIAGNOSTIC_SEED)
            record["rollout_identical"] = diagnosis["identical"]
        records.append(record)
        if out is not None:
            metrics.append_jsonl(record, out)
        say(table.row(records[-1]))
        bar.update(1)
    bar.close()


def _sync(actor: _Worker, rollout: _Worker, *, version: int, step: int, delta: Any,
          train: dict[str, Any] | None) -> dict[str, Any]:
    report = actor.call("sync", version=version)
    applied = rollout.call("sync", version=version)
    verified = None
    if delta.weight_update_delta_diagnostics.weight_digests:
        verified = actor.call("verify", version=version, rollout_digests=applied["digests"])
    log.info("v%d %s %d B verified=%s", version, report["kind"], report["payload_bytes"],
             verified)
    return metrics.record(report, applied, method=delta.weight_update_delta_method.value,
                          verified=verified, step=step, train=train)
