"""The awex weight-update group, built as AReaL builds it, on any torch cluster mode runs.

AReaL 1.0.4's ``init_custom_process_group`` picks the keyword of torch's
``_new_process_group_helper`` by comparing version strings ("2.10" < "2.6"), so on torch
>= 2.10 it passes the removed ``pg_options`` and fails. This builds the same group (the
same TCP rendezvous, ``PrefixStore`` under the group name, group ranks equal to transfer
ranks) with the current keyword; `compat.check_trainer` checks the helper's signature.
Unlike AReaL's, it also tells torch which group rank this process is (`_rank_map`).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["weight_update_group"]


def weight_update_group(*, master_addr: str, master_port: int, rank: int, world_size: int,
                        name: str, backend: str,
                        timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """Join the group ``name`` of ``world_size`` transfer ranks as ``rank``.

    Every member calls this with the same master, name and backend; the call returns
    once all have joined. ``dist.get_rank(group)`` is ``rank`` and the peers of
    point-to-point operations are named through ``dist.get_global_rank(group, peer)``.
    """
    # Launchers such as torchrun make every store the agent's; this group needs its own.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)
    timeout = timeout or c10d.default_pg_timeout
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_addr}:{master_port}", rank,
                                                   world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(name, store),
        group_name=name, backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = _rank_map(rank, world_size)
    return group


def _rank_map(rank: int, world_size: int) -> dict[int, int]:
    """torch's ``{global rank: group rank}`` of the group, as this process sees it.

    torch answers ``dist.get_rank(group)`` by looking this process's rank in the default
    group up here, and ``get_global_rank`` (point-to-point peers) by the inverse. The
    default group is another world (Megatron's or SGLang's), so AReaL's identity map
    gives a process its default rank, not its transfer rank. This maps the default rank
    to the transfer rank and gives every other member a key no default rank has; code
    that names peers by transfer rank as global ranks (AReaL's ``setup_batch_isend_irecv``,
    awex's send and receive ops) does not run on this group.
    """
    me = dist.get_rank() if dist.is_initialized() else rank
    spare = max(me, world_size) + 1
    return {(me if peer == rank else spare + peer): peer for peer in range(world_size)}
