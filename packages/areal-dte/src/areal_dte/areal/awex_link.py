"""What both delta adapters take from AReaL's ``/connect``: awex's plan, the geometry and
the weight-update group.

AReaL's gateway hands every adapter the same numbers (pair, master, world, how many
inference ranks per engine and engines, its own transfer rank) and the merged weight
metas in its KV store. From them each side builds:

- awex's own transfer plan, as AReaL does: awex matches the two sides' names and shapes
  and raises on a mismatch, so a model the rollout does not hold stops here;
- the rollout's shards in ``dte_codec``'s geometry: engine ``e``'s TP rank ``r`` is
  transfer rank ``e * I + r`` (AReaL numbers inference ranks first), its SGLang layout
  read off the inference metas and checked against them (names, padded shapes);
- the group (`group.weight_update_group`): NCCL where CUDA is, else gloo; the trainers
  are the transfer ranks after the inference ones. `warm_up` stands for AReaL's
  liveness exchange on it.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from dte_codec import Frame
from dte_codec.geometry import Shard
from dte_codec.layouts import EMBED, LM_HEAD, ModelConfig, canonical_tensors
from dte_codec.sglang_layout import SGLangLayout, sglang_shard
from dte_transport.group import Roles
from dte_transport.two_round import exchange

from ..areal_import import areal_module
from ..errors import UnsupportedModelError
from .group import weight_update_group

__all__ = ["Connection", "connect", "warm_up"]


@attrs.frozen(kw_only=True)
class Connection:
    """One adapter's view of a connected pair."""

    group: object = attrs.field(eq=False)
    """The weight-update process group (ranks are transfer ranks)."""
    device: torch.device
    """Where buffers of the group's collectives live."""
    roles: Roles
    """Inference transfer ranks roll out, training ones train."""
    awex_plan: object = attrs.field(eq=False)
    """awex's ``TransferPlan`` of this transfer rank (kept as AReaL keeps it)."""
    rollout_shards: tuple[Shard, ...]
    """Every inference rank's shard, ranked by transfer rank."""
    stream_id: str
    """The pair's name: one trajectory per connection."""


def connect(*, config: ModelConfig, pair_name: str, master_addr: str, master_port: int,
            transfer_rank: int, world_size: int, kv_store_url: str, infer_world_size: int,
            train_world_size: int, num_engines: int) -> Connection:
    """Plan and join the pair's group (every transfer rank calls this, as AReaL's own
    ``init_weight_update_group`` is called on all of them).

    Raises:
        UnsupportedModelError: the inference metas are not ``config`` in an SGLang layout.
        awex's and torch's own errors: names that awex cannot match, a failed rendezvous.
    """
    fetch_kv_metadata = areal_module("areal.experimental.weight_update.awex").fetch_kv_metadata
    builder = areal_module("awex.transfer.transfer_plan").TransferPlanBuilder
    infer_meta, train_meta = fetch_kv_metadata(kv_store_url, pair_name)
    awex_plan = builder(infer_world_size=infer_world_size, train_world_size=train_world_size,
                        num_infer_engines=num_engines).build_local_transfer_plan(
        infer_meta, train_meta, global_transfer_rank=transfer_rank)
    layout = rollout_layout(config, infer_meta, tp=infer_world_size)
    shards = tuple(attrs.evolve(sglang_shard(config, layout, rank=r), rank=e * layout.tp + r)
                   for e in range(num_engines) for r in range(layout.tp))
    rollouts = infer_world_size * num_engines
    backend, device = ("nccl", torch.device("cuda", torch.cuda.current_device())) if (
        torch.cuda.is_available()) else ("gloo", torch.device("cpu"))
    group = weight_update_group(master_addr=master_addr, master_port=master_port,
                                rank=transfer_rank, world_size=world_size,
                                name=f"awex_{pair_name}", backend=backend)
    return Connection(group=group, device=device, awex_plan=awex_plan, rollout_shards=shards,
                      roles=Roles(range(rollouts, rollouts + train_world_size), range(rollouts)),
                      stream_id=pair_name)


def rollout_layout(config: ModelConfig, infer_meta, *, tp: int) -> SGLangLayout:
    """The SGLang layout of one engine, its EP size read off the metas, checked against
    the metas' names and (vocab-padded) global shapes.

    Raises:
        UnsupportedModelError: the metas describe other tensors.
    """
    ep = 1 + max((s.ep_rank for m in infer_meta for s in m.shards), default=0)
    layout = SGLangLayout(tp=tp, ep=ep if config.is_moe else 1)
    padded = layout.padded_vocab(config)
    expected = {name: (padded, *spec.shape[1:]) if name in (EMBED, LM_HEAD) else spec.shape
                for name, spec in canonical_tensors(config).items()}
    got = {m.name: tuple(m.global_shape) for m in infer_meta}
    if got != expected:
        differ = sorted(set(got.items()) ^ set(expected.items()))
        raise UnsupportedModelError("rollout weight metas (name, global shape)",
                                    expected=f"those of {config}", got=f"differences {differ[:4]}")
    return layout


def warm_up(link: Connection) -> None:
    """What AReaL's ``/awex/batch_isend_irecv`` is for, on this group: every
    trainer-to-rollout path opened once before the first version (NCCL opens them
    lazily). AReaL's own helper names peers through an identity rank map, which this
    group does not have (`group.weight_update_group`). Every transfer rank calls it.
    """
    me = dist.get_rank(link.group)
    peers = link.roles.rollouts if me in link.roles.trainers else ()
    probe = Frame(b"\0", (torch.zeros(8, dtype=torch.uint8, device=link.device),))
    exchange({peer: probe for peer in peers}, group=link.group, device=link.device)
