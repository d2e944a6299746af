"""Expert parallelism: a mixture of experts' token-expert pairs sent to the devices that hold
their experts and their outputs sent back, by all-to-all (``model.moe.dispatch=all_to_all``;
model/moe.py, docs/moe.md).

Inside the MoE block's ``shard_map`` each device of the expert-parallel group (the mesh axes the
experts are split over: ``fsdp`` x ``sequence`` by the rules table) holds ``E / P`` of the
``E`` experts whole, device ``j`` experts ``[j E/P, (j + 1) E/P)``, and routes its own tokens.
Its pairs, sorted by expert, are then one contiguous chunk per destination device. The chunks
travel by ``jax.lax.ragged_all_to_all`` on GPU and TPU; XLA:CPU does not implement that
collective, so on a CPU by ``padded_ragged_all_to_all``: the same arguments and result, each
chunk padded to a fixed size and sent by ``jax.lax.all_to_all``. A device receives its chunks
into one buffer of ``M`` rows, sender by sender: dropless needs room for every device's pairs
(``M = P N``, ``N`` the pairs a device routes), ``model.moe.receive_buffer`` sets a smaller one
(a multiple of ``N``) and the pairs past it are dropped, later senders' first, and counted.

Every device learns every other device's per-expert counts (an all-gather of ``P x E``
integers), so senders and receivers agree on the chunk sizes, the offsets and the drops without
a second round. The expert outputs return by the same collective with the roles swapped, and
autodiff's transpose of each collective is the other direction's: the experts' gradients stay
on their device."""
from __future__ import annotations

import jax
import jax.numpy as jnp

EXCHANGES = ("ragged", "padded", "shape")
# the named scope of the exchanges: the planner counts these all-to-alls as the step's own, not
# attention's (planning/step_time.py)
EXCHANGE_SCOPE = "moe_exchange"


def exchange_impl(grouped: str, platform: str | None = None) -> str:
    """The all-to-all for a grouped-matmul implementation: ``ragged_all_to_all`` on GPU and TPU,
    the padded emulation on a CPU, and for the planner's stand-in (``grouped=ragged_shape``: a
    GPU's program compiled on CPU devices) a padded exchange of a balanced chunk's size: the
    bytes a ragged exchange moves, not its values."""
    if grouped == "ragged_shape":
        return "shape"
    return "padded" if (platform or jax.default_backend()) == "cpu" else "ragged"


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                             recv_sizes, *, axis_name, chunk: int):
    """``jax.lax.ragged_all_to_all``'s arguments and result on any backend: each of the ``P``
    chunks ``operand[input_offsets[j]:][:send_sizes[j]]`` (at most ``chunk`` rows) goes to
    device ``j`` of ``axis_name`` padded to ``chunk`` rows by ``jax.lax.all_to_all``, and is
    written into ``output`` at the offset its sender gave in ``output_offsets``."""
    rows = jnp.arange(chunk)
    take_PC = input_offsets[:, None] + rows[None]
    valid_PC = rows[None] < send_sizes[:, None]
    send_PCD = jnp.where(valid_PC.reshape(valid_PC.shape + (1,) * (operand.ndim - 1)),
                         jnp.take(operand, take_PC, axis=0, mode="fill", fill_value=0), 0)
    recv_PCD = jax.lax.all_to_all(send_PCD, axis_name, 0, 0)
    at_P = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    # rows past a chunk's size go nowhere (an index past the end, dropped by the scatter)
    at_PC = jnp.where(rows[None] < recv_sizes[:, None], at_P[:, None] + rows[None],
                      output.shape[0])
    return output.at[at_PC.reshape(-1)].set(recv_PCD.reshape(-1, *operand.shape[1:]),
                                            mode="drop")


@jax.named_scope(EXCHANGE_SCOPE)
def _exchange(kind: str, operand, output, input_offsets, send_sizes, output_offsets,
              recv_sizes, axis_name, chunk: int):
    if kind == "ragged":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axis_name)
    return padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                    recv_sizes, axis_name=axis_name, chunk=chunk)


def plan(counts_PE, me, buffer: int):
    """Who sends what where, from every device's per-expert pair counts ``counts_PE`` (device i
    routes ``counts_PE[i, e]`` pairs to expert e) and the receive buffer's rows: a dict of

    - ``sent_PP[i, j]``: the pairs device i sends device j (its chunk, cut where j's buffer is
      full: earlier senders first);
    - ``at_PP[i, j]``: where device i's chunk starts in j's buffer;
    - ``from_PP[i, j]``: where device i's chunk for j starts among i's sorted pairs;
    - ``kept_Pe``: of the pairs this device (``me``) receives, how many per sender and per local
      expert (the chunk is sorted by expert, so a cut chunk keeps its lower experts' pairs)."""
    P, E = counts_PE.shape
    counts_PPe = counts_PE.reshape(P, P, E // P)
    whole_PP = counts_PPe.sum(-1)
    at_PP = _exclusive_cumsum(whole_PP, axis=0)
    sent_PP = jnp.clip(buffer - at_PP, 0, whole_PP)
    mine_Pe = jax.lax.dynamic_index_in_dim(counts_PPe, me, axis=1, keepdims=False)
    sent_P = jax.lax.dynamic_index_in_dim(sent_PP, me, axis=1, keepdims=False)
    kept_Pe = jnp.clip(sent_P[:, None] - _exclusive_cumsum(mine_Pe), 0, mine_Pe)
    return {"sent_PP": sent_PP, "at_PP": at_PP, "from_PP": _exclusive_cumsum(whole_PP),
            "kept_Pe": kept_Pe}


def experts_all_to_all(x_TD, weights_TK, experts_TK, w_gate_eDF, w_up_eDF, w_down_eFD, *,
                       axis_name, num_experts: int, grouped, exchange: str,
                       receive_buffer: float = 0.0, capacity: int = 0,
                       rows=None):
    """(output [T, D], dropped pairs): ``model/moe.py experts_forward`` for a device holding
    experts ``[me E/P, (me + 1) E/P)`` (``w_*_e..``, ``e = E / P``) of the expert-parallel group
    ``axis_name`` (``P`` devices): its pairs sent to their experts' devices and back.
    ``grouped(x, w, sizes)`` is the grouped matmul; ``exchange`` one of ``EXCHANGES``;
    ``capacity`` > 0 keeps each expert's first ``capacity`` of this device's pairs. ``rows(xs,
    sizes)``, when given, is the local experts' MLP on rows sorted by expert (model/moe.py
    ``expert_rows``: gpt-oss's biases and clamped unit); else SwiGLU by ``grouped``."""
    T, K = experts_TK.shape
    N, E = T * K, num_experts
    P = E // w_gate_eDF.shape[0]
    me = jax.lax.axis_index(axis_name)
    buffer = P * N if not receive_buffer else max(1, min(P * N, int(receive_buffer * N)))

    expert_N = experts_TK.reshape(-1)
    if capacity:  # past an expert's capacity: sorted last (expert E), never sent
        first = jnp.argsort(expert_N, stable=True)
        sizes = jnp.bincount(expert_N, length=E)
        rank = jnp.zeros(N, jnp.int32).at[first].set(
            jnp.arange(N, dtype=jnp.int32) - _exclusive_cumsum(sizes)[expert_N[first]])
        expert_N = jnp.where(rank < capacity, expert_N, E)
    order_N = jnp.argsort(expert_N, stable=True)  # by expert, then by token
    counts_E = jnp.zeros(E + 1, jnp.int32).at[expert_N].add(1)[:E]
    counts_PE = jax.lax.all_gather(counts_E, axis_name)
    p = plan(counts_PE, me, buffer)
    row = lambda a: jax.lax.dynamic_index_in_dim(a, me, axis=0, keepdims=False)  # noqa: E731
    col = lambda a: jax.lax.dynamic_index_in_dim(a, me, axis=1, keepdims=False)  # noqa: E731
    sent_P, from_P, at_P = row(p["sent_PP"]), row(p["from_PP"]), row(p["at_PP"])
    recv_P = col(p["sent_PP"])

    if exchange == "shape":  # the planner's balanced chunks (bytes, not values)
        chunk = -(-N // P)
    else:
        chunk = min(N, buffer)
    xs_ND = x_TD[order_N // K]
    recv_MD = _exchange(exchange, xs_ND, jnp.zeros((buffer, x_TD.shape[1]), x_TD.dtype),
                        from_P, sent_P, at_P, recv_P, axis_name, chunk)

    # the received rows, sender by sender and each sender's by expert: sorted by local expert
    e = w_gate_eDF.shape[0]
    kept_Pe = p["kept_Pe"]
    local_M = jnp.repeat(jnp.tile(jnp.arange(e, dtype=jnp.int32), P), kept_Pe.reshape(-1),
                         total_repeat_length=buffer)
    local_M = jnp.where(jnp.arange(buffer) < kept_Pe.sum(), local_M, e)  # the buffer's rest
    by_expert_M = jnp.argsort(local_M, stable=True)
    sizes_e = kept_Pe.sum(0).astype(jnp.int32)
    xs_MD = recv_MD[by_expert_M]
    if rows is None:
        h_MF = (jax.nn.silu(grouped(xs_MD, w_gate_eDF, sizes_e))
                * grouped(xs_MD, w_up_eDF, sizes_e))
        out_MD = grouped(h_MF, w_down_eFD, sizes_e)
    else:
        out_MD = rows(xs_MD, sizes_e)
    ys_MD = jnp.zeros((buffer, w_down_eFD.shape[-1]), recv_MD.dtype).at[by_expert_M].set(
        out_MD.astype(recv_MD.dtype))

    # back: each chunk to its sender, where it left from
    ys_ND = _exchange(exchange, ys_MD, jnp.zeros((N, ys_MD.shape[1]), ys_MD.dtype),
                      col(p["at_PP"]), recv_P, col(p["from_PP"]), sent_P, axis_name, chunk)
    dest_N = jnp.minimum(expert_N[order_N] // e, P - 1)
    rank_N = jnp.arange(N) - from_P[dest_N]
    kept_N = (expert_N[order_N] < E) & (rank_N < sent_P[dest_N])
    weights_N = jnp.where(kept_N, weights_TK.reshape(-1)[order_N], 0.0)
    y_ND = jnp.zeros_like(ys_ND).at[order_N].set(ys_ND * weights_N[:, None].astype(ys_ND.dtype))
    return y_ND.reshape(T, K, -1).sum(axis=1), (N - jnp.sum(kept_N)).astype(jnp.int32)
