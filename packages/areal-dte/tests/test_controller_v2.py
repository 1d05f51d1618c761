"""With the areal extra: AReaL 1.0.4's HTTP layer around a rollout that refuses a version.

Real, as AReaL 1.0.4 ships them and over real sockets on localhost: AReaL's v2 PPO actor
controller (under `DeltaActorControllerV2`), its ``WeightUpdateController`` starting AReaL's
weight-update gateway as a subprocess (FastAPI under uvicorn, started from
`areal_dte.areal.weight_gateway`, posting to the workers with aiohttp), AReaL's
``RolloutControllerV2`` pausing and resuming generation through its data-proxy client, and
AReaL's request to a train worker's ``/configure`` route.

Stand-ins, all in one aiohttp server in this process (one port per role), because no
worker can start here (no GPU, no SGLang server, no Megatron stack on Python 3.11):

- the SGLang server's ``/awex/*`` routes. AReaL's own routes answer a failed update with 500
  and the scheduler's exception text. This one refuses a version with 400 and a text, the
  rollout's refusal, and accepts it the next time (or refuses it again).
- the train worker's Flask app: it answers the ``/awex/*`` routes at once (no collective
  runs), and its ``/configure`` route calls ``configure`` on a `FullSyncRequests`, the mixin
  areal-dte's Megatron actor takes it from.
- the rollout's data proxy (pause, continue) and the train guard's port allocator.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from areal_dte.areal import compat
from areal_dte.errors import IncompatibleStackError, WeightUpdateRefusedError
from areal_dte.areal.full_sync_request import FullSyncRequests

pytestmark = pytest.mark.areal

REFUSAL = "payload rejected (base_mismatch): delta onto v6, holding v5; holding version 5"
"""What the stand-in rollout answers with its 400: a receiver's refusal, as areal-dte
words it."""
UPDATE = "/awex/update_weights"
ANSWERS = {"400-text": (400, REFUSAL, "text/plain"),
           "500-areal-json": (500, '{"error": "RPC awex_execute_weight_update failed: '
                                   + REFUSAL + '"}', "application/json")}
"""How a rollout refuses: the stand-in's 400 and a text; and the answer shape of AReaL's own
SGLang route, whose 500 carries the scheduler's exception text in JSON."""
ROLES = ("train", "rollout", "proxy", "guard")


class Workers:
    """The stand-in servers (see the module docstring), each request recorded in order."""

    def __init__(self):
        self.refusals, self.answer = 0, ANSWERS["400-text"]
        self.calls: list[tuple[str, str, object]] = []
        self.engine = FullSyncRequests()
        self.urls: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Workers:
        self._thread.start()
        self._started.wait(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for role in ROLES:
            app.router.add_route("*", f"/{role}/{{path:.*}}", self._answer)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.urls = {role: f"http://127.0.0.1:{port}/{role}" for role in ROLES}
        self._started.set()
        self._loop.run_forever()

    async def _answer(self, request):
        from aiohttp import web
        from areal.infra.rpc.serialization import deserialize_value, serialize_value

        role, path = request.path.split("/", 2)[1], "/" + request.match_info["path"]
        body = await request.json() if request.can_read_body else None
        self.calls.append((role, path, body))
        if path == "/alloc_ports":
            return web.json_response({"host": "127.0.0.1", "ports": [29_500]})
        if path == "/awex/report_parallelism":
            return web.json_response({"world_size": 1})
        if path == "/awex/report_weight_meta":
            return web.json_response({"meta": []})
        if path == "/configure":
            self.engine.configure(**deserialize_value(body["kwargs"]))
            return web.json_response({"status": "success", "result": serialize_value(None)})
        if role == "rollout" and path == UPDATE and self.refusals:
            self.refusals -= 1
            status, text, content_type = self.answer
            return web.Response(status=status, text=text, content_type=content_type)
        return web.json_response({"status": "ok"})

    def seen(self, *paths: str) -> list[tuple[str, str, object]]:
        """The recorded requests to ``paths``, in order."""
        return [call for call in self.calls if call[1] in paths]


@pytest.fixture(scope="module")
def areal():
    """AReaL's v2 controller module, or a skip without the areal extra."""
    return pytest.importorskip("areal.experimental.training_service.controller.controller",
                               reason="needs the areal extra (see packages/areal-dte/README.md)")


@pytest.fixture
def trainer_log(areal, tmp_path):
    """A function: -> the trainer's log file, as PPOTrainer sets it up (AReaL's
    setup_file_logging, once per process; a file set up earlier in the process is kept)."""
    from areal.utils.logging import setup_file_logging
    from areal_dte.areal import controller_v2

    setup_file_logging(str(tmp_path / "logs"))
    (path,) = {h.baseFilename for h in controller_v2.log.handlers
               if isinstance(h, logging.FileHandler) and h.baseFilename.endswith("main.log")}
    return lambda: Path(path)


@pytest.fixture(scope="module")
def connected(areal, tmp_path_factory) -> Iterator:
    """The actor controller connected over the stand-ins (one gateway for the module)."""
    from areal.api.cli_args import InferenceEngineConfig, PPOActorConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.experimental.inference_service.controller.controller import RolloutControllerV2
    from areal_dte.areal.controller_v2 import DeltaActorControllerV2

    with Workers() as workers:
        actor = DeltaActorControllerV2(
            train_engine="areal_dte.megatron_actor.DeltaMegatronPPOActor",
            config=PPOActorConfig(backend="megatron:d1p1t1", experiment_name="e",
                                  trial_name="t", path=str(tmp_path_factory.mktemp("model"))),
            scheduler=None)
        rollout = RolloutControllerV2(
            InferenceEngineConfig(admin_api_key="test-key", model="m", api_url="http://unused"),
            scheduler=None)
        # What the controllers' initialize() records once their workers have started.
        actor._role, actor._worker_addrs, actor._guard_addrs = (
            "actor", [workers.urls["train"]], [workers.urls["guard"]])
        rollout._inf_addrs, rollout._data_proxy_addrs = ([workers.urls["rollout"]],
                                                         [workers.urls["proxy"]])
        actor.connect_engine(rollout, WeightUpdateMeta.from_awex())
        try:
            yield actor, workers
        finally:
            actor._weight_update_ctrl.destroy()


@pytest.fixture
def connect(connected):
    """A function: refusals, answer -> (the connected controller, the stand-ins refusing the
    next ``refusals`` updates with ``ANSWERS[answer]``, their record cleared)."""

    def refusing(refusals: int, answer: str = "400-text"):
        actor, workers = connected
        workers.refusals, workers.answer = refusals, ANSWERS[answer]
        workers.calls.clear()
        workers.engine.take_full_sync_request(-1)  # drops any earlier test's request
        return actor, workers

    return refusing


@pytest.mark.parametrize("answer", ANSWERS)
def test_refused_version_is_logged_and_sent_again_in_full(connect, trainer_log, answer):
    """The rollout's refusal text (a 400 with a text; AReaL's own route's 500 with JSON)
    reaches the trainer's log through AReaL's gateway; every
    train worker is asked to send that version in full (with the text) before the version
    is asked for once more; the gateway asked each worker once per attempt (no retries of
    a weight update); generation was paused once and resumed once."""
    from areal.api.io_struct import WeightUpdateMeta

    actor, workers = connect(refusals=1, answer=answer)
    earlier = len(trainer_log().read_text().splitlines())
    actor.update_weights(WeightUpdateMeta.from_awex().with_version(6))
    order = [(role, path) for role, path, _ in workers.seen(UPDATE, "/configure")]
    assert [("rollout", UPDATE), ("train", UPDATE), ("train", "/configure"),
            ("rollout", UPDATE), ("train", UPDATE)] == (
        sorted(order[:2]) + order[2:3] + sorted(order[3:]))
    assert [{"version": 6}] * 4 == [body for _, _, body in workers.seen(UPDATE)]
    logged = [line for line in trainer_log().read_text().splitlines()[earlier:]
              if REFUSAL in line and "sending v6 again, in full" in line]
    assert 1 == len(logged)
    request = workers.engine.take_full_sync_request(6)
    assert (6, True) == (request.version, REFUSAL in request.reason)
    assert ["/pause_generation", "/continue_generation"] == [
        path for role, path, _ in workers.calls if role == "proxy"]


def test_version_refused_again_raises_with_the_text(connect):
    """A version refused in full too raises WeightUpdateRefusedError carrying the text, so
    PPOTrainer (which calls set_version after update_weights returns) records nothing;
    generation is resumed all the same."""
    from areal.api.io_struct import WeightUpdateMeta

    actor, workers = connect(refusals=2)
    with pytest.raises(WeightUpdateRefusedError) as caught:
        actor.update_weights(WeightUpdateMeta.from_awex().with_version(6))
    answer = f"{workers.urls['rollout']}{UPDATE} answered 400: {REFUSAL}"
    expected = f"v6: weight update failed: {answer}"
    assert (expected, 4) == (str(caught.value), len(workers.seen(UPDATE)))
    assert "/continue_generation" == [p for r, p, _ in workers.calls if r == "proxy"][-1]


def test_accepted_version_asks_once(connect):
    """An accepted version: one request per worker, no full-sync request."""
    from areal.api.io_struct import WeightUpdateMeta

    actor, workers = connect(refusals=0)
    actor.update_weights(WeightUpdateMeta.from_awex().with_version(1))
    assert ([("rollout", UPDATE, {"version": 1}), ("train", UPDATE, {"version": 1})], None) == (
        sorted(workers.seen(UPDATE)), workers.engine.take_full_sync_request(1))


def test_other_areal_release_is_refused_at_construction(areal, monkeypatch):
    """The private names wrapped are AReaL 1.0.4's: another release fails when the
    controller is built, naming what it expected."""
    from areal_dte.areal.controller_v2 import check_controller

    monkeypatch.setattr(compat, "version", lambda distribution: "1.0.5")
    with pytest.raises(IncompatibleStackError) as caught:
        check_controller()
    assert ("areal version: expected 1.0.4, got 1.0.5; cluster mode installs itself into "
            "these exact versions (packages/areal-dte/README.md)") == str(caught.value)


def test_gateway_that_posts_otherwise_is_refused(areal):
    """keep_refusals checks that AReaL's gateway posts weight updates through its _post; a
    gateway whose transfer closure does not is refused before anything is replaced."""
    import types

    from areal_dte.areal.weight_gateway import keep_refusals

    def create_app():
        async def _awex_transfer_weights(session, url):
            return await session.post(url + UPDATE)
        return _awex_transfer_weights

    gateway = types.ModuleType("gateway")
    gateway.create_app, gateway._post = create_app, None
    with pytest.raises(IncompatibleStackError) as caught:
        keep_refusals(gateway)
    assert ("areal.experimental.weight_update.gateway.app.create_app._awex_transfer_weights",
            "code that uses _post", None) == (caught.value.what, caught.value.expected,
                                               gateway._post)
