"""``XcclLink`` over a real gloo process group (marker ``areal``: it builds AReaL's
``areal.api.ParamSpec``).

Two spawned ranks of one gloo group (``xccl_world``). Real: ``XcclLink`` on rank 0 with
AReaL 1.0.4's ``ParamSpec``, the gloo group and the broadcast of each payload's uint8
tensor from rank 0, ``dte_transport``'s ``Sender`` and ``Receiver``, the codec, and
areal-dte's ``PayloadRejectedError`` as the refusal. Stand-ins: AReaL's rollout handle
(``RolloutCallback``'s HTTP round trip through the controller to every server) is a pipe
to one worker, whose answer it returns as a future that raises SGLang's message on
failure; SGLang's request loop is ``update_weights_from_distributed`` in brief (join the
broadcast, ``load_weights``, answer success or "Failed to update parameter online: ..."),
its ``load_weights`` one of three: a ``Receiver`` over plain Hugging Face-named bf16
tensors that raises ``PayloadRejectedError`` as the plugin-routed receiver does, SGLang's
loader that skips unknown names, or a refusal for another reason; damage in flight is a
byte the worker flips before the load. Every server joins the
broadcast before it answers (SGLang 0.5.23 refuses outside a session before joining; not
run here). AReaL 1.0.4's own handle does not bring SGLang's message back to the future
(its HTTP client raises on the status before it reads the body); these tests check
``XcclLink`` on the premise that the message arrives.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import re

import attrs
import pytest
import torch
from areal_dte.errors import REFUSAL, PayloadRejectedError
from areal_dte.xccl_link import PROBE
from bitwise import assert_same_bits, first_difference
from dte_transport import Receiver
from group_worker import finish, rendezvous
from xccl_world import (
    CORRUPT,
    GROUP_NAME,
    RAISED,
    SESSION,
    SHAPES,
    SUCCESS,
    WRONG_BASE,
    head,
    sglang_failure,
    worker,
)

pytestmark = pytest.mark.areal

ANSWER_SECONDS = 120
"""How long rank 0 may take over one command (its first one imports AReaL)."""


@attrs.frozen
class Ranks:
    """The test process's ends: commands to rank 0, rank 1's answers."""

    control: object
    far: object

    def ask(self, *command: object) -> tuple[object, list[tuple]]:
        """Rank 0's outcome of ``command`` and rank 1's answer to each of its requests."""
        self.control.send(command)
        assert self.control.poll(ANSWER_SECONDS), f"rank 0 did not answer {command}"
        status, outcome, requests = self.control.recv()
        if status == RAISED:
            pytest.fail(f"rank 0 raised on {command}:\n{outcome}")
        return outcome, [self.far.get(timeout=ANSWER_SECONDS) for _ in range(requests)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Rank 0 (the trainer's pipeline head) and rank 1 (an SGLang TP worker) in one gloo
    group for the whole module; both must end cleanly after it."""
    if importlib.util.find_spec("areal") is None:
        pytest.skip("needs the areal extra (see packages/areal-dte/README.md)")
    context = multiprocessing.get_context("spawn")
    store = rendezvous(tmp_path_factory.mktemp("xccl"))
    control, head_control = context.Pipe()
    head_requests, worker_requests = context.Pipe()
    far = context.Queue()
    procs = [context.Process(target=head, args=(store, head_control, head_requests)),
             context.Process(target=worker, args=(store, worker_requests, far))]
    for proc in procs:
        proc.start()
    for end in (head_control, head_requests, worker_requests):
        end.close()  # a rank that dies leaves its peer an end-of-file, not a wait
    yield Ranks(control, far)
    control.send(None)
    assert ([], [0, 0]) == finish(procs, ANSWER_SECONDS)


def test_check_passes_when_the_receiver_refuses_the_probe(ranks):
    """The probe reaches areal-dte's receiver, which refuses bytes that are no payload;
    ``check`` takes that refusal as the proof that the rollout applies payloads."""
    outcome, [(server, success, message, bits)] = ranks.ask("check", "receiver-check")
    refusal = sglang_failure(PayloadRejectedError(Receiver({}).receive(PROBE)))
    assert ("passed", "receiver-check", False, refusal) == (outcome, server, success, message)
    assert_same_bits({name: torch.zeros(shape, dtype=torch.int16)
                      for name, shape in SHAPES.items()}, _tensors(bits))


def test_check_raises_when_the_rollout_answers_success(ranks):
    """A rollout without areal-dte's receiver skips the unknown tensor and answers
    success: it would skip payloads too, so ``check`` stops the run."""
    outcome, answers = ranks.ask("check", "plain")
    assert ("DeltaSyncError: the rollout's answer to bytes that are no payload: expected a "
            "refusal (areal_dte.sglang_receiver applying payloads in load_weights), got "
            "success, so it ignores payloads") == outcome
    assert [("plain", True, SUCCESS, {})] == answers


def test_check_raises_when_the_rollout_refuses_for_another_reason(ranks):
    """A refusal that is not the receiver's (here SGLang 0.5.23's, outside a weight-update
    session) proves nothing about payloads: ``check`` stops the run and names it."""
    outcome, answers = ranks.ask("check", "session")
    refusal = sglang_failure(SESSION)
    assert ("DeltaSyncError: the rollout's answer to bytes that are no payload: expected "
            f"areal_dte's receiver refusing them ({REFUSAL!r}), got {len(PROBE)} B not "
            f"delivered over {GROUP_NAME}: {refusal}") == outcome
    assert [("session", False, refusal, {})] == answers


REFUSED = {
    WRONG_BASE: re.escape(f"{REFUSAL} (wrong_base): delta onto version 2, holding 1; "
                          "holding version 1"),
    CORRUPT: re.escape(f"{REFUSAL} (bad_payload): digest: ")
    + r"expected 0x[0-9a-f]{16}, got 0x[0-9a-f]{16}; holding version 2",
}
HELD = {WRONG_BASE: [1, 2, 1, 1, 3, 4], CORRUPT: [1, 2, 2, 3, 4]}
"""The version the far side holds after each request, in order."""
ACCEPTED = {WRONG_BASE: [True, True, True, False, True, True],
            CORRUPT: [True, True, False, True, True]}


@pytest.mark.parametrize("fault", [WRONG_BASE, CORRUPT])
def test_sender_syncs_bit_exact_and_falls_back_to_full_after_a_refusal(fault, ranks):
    """Through ``Sender(XcclLink)``: v1 full, v2 a delta, a v3 delta the receiver refuses
    (onto a base it no longer holds, or damaged in flight) raises ``SyncError`` with the
    receiver's reason and leaves the far side as it was, v3 then goes full and v4 as a
    delta again. After every request the far side's bits equal the version it holds."""
    (outcomes, versions), answers = ranks.ask("sync", f"receiver-{fault}", fault)
    versions = {v: _tensors(bits) for v, bits in versions.items()}
    assert ["full no_base", "delta delta", "full no_base", "delta delta"] == (
        outcomes[:2] + outcomes[3:])
    before, after = sglang_failure("\0").split("\0")
    refused = (r"SyncError: version 3 was not delivered: link failed: \d+ B not delivered over "
               + re.escape(f"{GROUP_NAME}: {before}") + REFUSED[fault]
               + re.escape(f"{after}; the next sync is full"))
    assert re.fullmatch(refused, outcomes[2]), outcomes[2]
    assert ACCEPTED[fault] == [success for _, success, _, _ in answers]
    for held, (_, _, _, bits) in zip(HELD[fault], answers, strict=True):
        assert_same_bits(versions[held], _tensors(bits))
    assert all(first_difference(versions[v], versions[v + 1]) for v in (1, 2, 3))


def _tensors(bits: dict) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in bits.items()}
