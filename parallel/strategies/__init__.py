"""Context-parallel strategies: which queries and which K/V blocks meet on a device.

Every strategy is exact, reads the same true positions and segment ids, and runs on one engine
(``engine.py``): a device holds some queries, starts with one K/V block, and passes blocks round
a ring of ``hops`` rounds (one hop: ``shift``), calling the per-round kernel on every chunk pair
(``rounds.py``); its dK/dV accumulators travel with the blocks and arrive home. What differs is
how the inputs become local and how the results go back:

- ``ring``: each device keeps its chunk of queries; the K/V blocks travel round all N devices.
- ``ulysses`` / ``usp`` (``usp.py``): an all-to-all inside groups of U neighbouring devices
  turns sequence-sharded into head-sharded, then a ring of N/U hops across the groups; the
  ring is usp with U = 1, ulysses usp with U = N (no ring).
- ``allgather`` (``allgather.py``): K/V gathered whole, one round, dK/dV reduce-scattered.
"""
from __future__ import annotations

IMPLS = ("ring", "allgather", "ulysses", "usp")


class Strategy:
    """What a strategy decides, for one call (``call.Call``); the engine does the rest.

    ``meet(q, k, v, pos, seg)`` (sequence-sharded ``[B, C, ...]``): this device's queries
    ``[B, S, Hq', D]``, their positions / segment ids ``[B, S]`` and the K/V block it starts
    with (``accumulators.KV``). ``to_heads`` moves a query-side array (the output cotangent,
    its row sums) the way ``meet`` moved the queries, ``to_seq`` moves a result back. After
    ``hops`` rounds, ``home`` turns a block's fp32 ``dk``/``dv [B, K, Sk, D]`` into this
    device's ``[B, C, Hkv, D]``. Only the first ``rounds`` of the ``hops`` rounds run when the
    later ones can have no work (a sliding window in the
    contiguous layout: ``parallel/window.py``).
    """

    hops = 1
    rounds = 1

    def __init__(self, call):
        self.call = call

    def shift(self, tree):
        raise NotImplementedError("a strategy with more than one hop defines its shift")

    def to_heads(self, x):
        return x

    def to_seq(self, x):
        return x

    def heads(self, x_H):
        """This device's share, in ``meet``'s head order, of a per-query-head array ``[H]``
        (the tensor shard's heads): all of them unless the queries were split by heads."""
        return x_H


def get(call) -> Strategy:
    """The strategy of a call (``call.impl``)."""
    if call.impl == "allgather":
        from parallel.strategies.allgather import AllGather
        return AllGather(call)
    from parallel.strategies.usp import Usp
    return Usp(call)
