"""Megatron-Core's interleaved pipeline schedule, the references its loop keeps
(``pipeline_parallel/schedules.py`` ``forward_backward_pipelining_with_interleaving``,
megatron-core 0.16.1, with or without its p2p overlap): the received inputs and output
gradients it holds in its lists and locals before their step runs or after it has, the input
gradients it keeps, the outputs still whole when their forward returns, the stand-ins of
deallocated outputs, and the losses in ``forward_data_store``. A hand model of that code over
abstract pipeline tensors; the estimator adds the tensors it names to the replay of an
interleaved rank under the megatron orchestration (``tracemem.estimator.trace_classes``,
``Segments.schedule_refs``), and ``tracemem.oracle.schedule_oracle`` holds the result against
Megatron-Core's own schedule run on meta, step by step to the byte.
"""

from __future__ import annotations

__all__ = ["INTERLEAVED_REFERENCES", "REFERENCE_NAMES", "interleaved_reference_tensors",
           "interleaved_references"]


class _Ref:
    """A pipeline tensor of ``interleaved_references``' model: "in" a received input, "ig"
    its gradient, "og" a received output gradient, "out" a forward's output (whole until
    deallocated; its autograd graph's AccumulateGrad Node holds ``inp``, the input)."""

    def __init__(self, kind: str, chunk: int | None = None, mb: int | None = None):
        self.kind, self.chunk, self.mb = kind, chunk, mb
        self.deallocated = False
        self.grad: _Ref | None = None
        self.inp: _Ref | None = None


# the kinds of interleaved_references' rows, in order
INTERLEAVED_REFERENCES = (
    "received inputs [s, b, h] bf16 the schedule holds that tracemem does not (received "
    "before their forward, or kept after their backward)",
    "input gradients [s, b, h] bf16 (the .grad of a kept input, the local input_tensor_grad)",
    "received output gradients [s, b, h] bf16 the schedule holds that tracemem does not",
    "outputs [s, b, h] bf16 still whole (deallocated after the send), less their stand-in",
    "finished microbatches' output stand-ins (bf16 [1])",
    "finished microbatches' losses fp32 [] in forward_data_store (last stage)",
)


# short names of INTERLEAVED_REFERENCES' kinds, in order (what a replayed storage is called)
REFERENCE_NAMES = ("received input", "input gradient", "received output gradient",
                   "output whole until sent", "output stand-in", "loss in forward_data_store")


def interleaved_reference_tensors(pp: int, vpp: int, num_microbatches: int, rank: int,
                                  hidden: int, overlap_p2p_comm: bool = False
                                  ) -> list[tuple[str, list[tuple[str, int]]]]:
    """What megatron-core 0.16.1's ``forward_backward_pipelining_with_interleaving``
    (``microbatch_group_size_per_vp_stage`` = PP, training, outputs deallocated after their
    send; the p2p overlap as ``overlap_p2p_comm`` says, without its warm-up-flush variant)
    references at each of its forward and backward steps beyond the traced
    segments' own storages: per step (its ``tracemem.schedules`` name), the tensors as
    (``INTERLEAVED_REFERENCES`` kind, raw bytes), sorted (``hidden``: one [s, b, h] pipeline
    tensor's bytes). ``replay_events`` holds them as storages of their own while the step
    runs (``Segments.schedule_refs``); ``tracemem.oracle.schedule_oracle`` holds the sum
    against Megatron-Core's own run of the schedule, to the byte.

    Read from ``pipeline_parallel/schedules.py``: ``get_schedule_table``,
    ``get_pp_rank_microbatches`` (warm-up count), ``recv_tensor_from_previous_stage``,
    ``forward_step_helper_preprocess`` (inputs taken from ``input_tensors[chunk]`` at
    ``microbatch - num_released_microbatches``, kept there until the backward pops them;
    ``forward_step`` sets the chunk's ``TransformerBlock.input_tensor``),
    ``backward_step_helper_preprocess`` (the backward pops input, output and output gradient
    into its locals), the warm-up, steady and cool-down loops (each communication receives the
    next forward's input and the next backward's output gradient into the schedule's locals
    and lists before they run; the steady step's forward output is held by the wrapper through
    the backward and deallocated after the send; a local keeps the last input gradient sent).
    A step is counted when ``forward_step`` / ``backward_step`` returns, as the oracle records
    it. A tensor is alive while any of those references it, an input also while its output's
    autograd graph does (its AccumulateGrad Node), its ``.grad`` while it is. tracemem's
    replay holds, for each microbatch between its forward and its backward, the received input
    (not on virtual stage 0) and the output's stand-in (not on the last virtual stage), or the
    loss (the last).

    With the p2p overlap (``config.overlap_p2p_comm``: Megatron-LM's default for the
    interleaved schedule, off with ``--no-overlap-p2p-communication``; ``batch_p2p_comm``
    then off) the steady loop runs ``forward_backward_helper_wrapper`` with its hooks:
    ``pp_post_forward`` posts the next forward's receive right after the forward, so that input
    is held through the backward (``fwd_recv_buffer``, appended to ``input_tensors``), and
    ``pp_post_backward`` the next output gradient's after the backward (``bwd_recv_buffer``,
    emptied once appended to ``output_tensor_grads``); the local ``input_tensor`` is not
    assigned after the warm-up, so the warm-up's last received input (and its ``.grad`` once
    its backward has run) stays referenced to the end of the loop."""
    group = pp
    table: list[tuple[int, int]] = []  # (microbatch, chunk) per virtual microbatch
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table += [(j, c) for c in range(vpp) for j in range(lo, hi)]
    total = num_microbatches * vpp
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * group
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    steady = total - warmup
    first_rank, last_rank = rank == 0, rank == pp - 1

    def chunk(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else vpp - c - 1

    def released(k: int, c: int) -> int:
        return 0 if k < warmup else [x[1] for x in table[:k - warmup]].count(vpp - c - 1)

    def first_v(c: int) -> bool:
        return c == 0 and first_rank

    def last_v(c: int) -> bool:
        return c == vpp - 1 and last_rank

    def receives(k: int, forward: bool) -> tuple[bool, int]:
        leading = first_rank if forward else last_rank
        if not leading:
            return True, chunk(k + 1, forward)
        nxt = chunk(k + 1 if k < pp - 1 else k - (pp - 1), forward)
        recv = k >= pp - 1 and nxt != (vpp - 1 if forward else 0)
        return recv, nxt + 1 if forward else nxt - 1

    inputs: list[list] = [[] for _ in range(vpp)]
    outputs: list[list] = [[] for _ in range(vpp)]
    grads: list[list] = [[] for _ in range(vpp)]
    local: dict[str, _Ref | None] = dict(input_tensor=None, output_tensor=None,
                                         output_tensor_grad=None, input_tensor_grad=None)
    block: list[_Ref | None] = [None] * vpp
    inflight: set[tuple[int, int]] = set()
    losses = [0]
    out: list[tuple[str, dict[str, int]]] = []

    def record(step: str, held: list) -> None:
        roots = [x for lists in (inputs, outputs, grads) for lst in lists for x in lst]
        roots += list(local.values()) + block + held
        alive: dict[int, _Ref] = {}
        stack = [x for x in roots if x is not None]
        while stack:
            t = stack.pop()
            if id(t) in alive:
                continue
            alive[id(t)] = t
            stack += [x for x in (t.grad, t.inp) if x is not None]
        k_in, k_ig, k_og, k_whole, k_stand, k_loss = INTERLEAVED_REFERENCES
        tensors: list[tuple[str, int]] = []
        for t in alive.values():
            flying = (t.chunk, t.mb) in inflight
            if t.kind == "in" and not flying:
                tensors.append((k_in, hidden))
            elif t.kind == "ig":
                tensors.append((k_ig, hidden))
            elif t.kind == "og":
                tensors.append((k_og, hidden))
            elif t.kind == "out" and not last_v(t.chunk):
                if not t.deallocated:  # less the stand-in the replay holds in flight
                    tensors.append((k_whole, hidden - (2 if flying else 0)))
                elif not flying:
                    tensors.append((k_stand, 2))
        tensors += [(k_loss, 4)] * losses[0]
        out.append((step, sorted(tensors)))

    def forward(k: int, held: tuple = ()) -> _Ref:
        c, j = chunk(k, True), table[k][0]
        if first_v(c) and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        x = inputs[c][j - released(k, c)]
        if x is not None:
            x.chunk, x.mb = c, j
        block[c] = x
        o = _Ref("out", c, j)
        o.inp = x
        inflight.add((c, j))
        record(f"{c * pp + rank}F{j}", [x, o, *held])
        outputs[c].append(o)
        return o

    def backward(k: int, held: tuple = ()) -> _Ref | None:
        c = chunk(k, False)
        if last_v(c) and not grads[c]:
            grads[c].append(None)
        x, o, g = inputs[c].pop(0), outputs[c].pop(0), grads[c].pop(0)
        if x is not None:
            x.grad = _Ref("ig", c, o.mb)
        inflight.discard((c, o.mb))
        losses[0] += last_v(c)
        record(f"{c * pp + rank}B{o.mb}", [x, o, g, *held])
        return x.grad if x is not None else None

    inputs[0].append(None if first_v(0) else _Ref("in"))
    for k in range(warmup):
        recv, nxt = receives(k, True)
        recv = recv and k != total - 1
        o = forward(k)
        local["output_tensor"] = None if last_v(chunk(k, True)) else o
        if k == warmup - 1 and not all_warmup:
            local["input_tensor_grad"] = None
            local["input_tensor"] = _Ref("in") if recv else None
            local["output_tensor_grad"] = None if last_rank else _Ref("og")
            grads[vpp - 1].append(local["output_tensor_grad"])
        else:
            local["input_tensor"] = _Ref("in") if recv else None
        if recv:
            inputs[nxt].append(local["input_tensor"])
        if local["output_tensor"] is not None:
            local["output_tensor"].deallocated = True
    for k in range(steady):
        fk = k + warmup
        o = forward(fk)
        recv_prev, nxt_f = receives(fk, True)
        recv_prev = recv_prev and k != steady - 1
        if overlap_p2p_comm and recv_prev:  # pp_post_forward: received before the backward
            inputs[nxt_f].append(_Ref("in"))
        ig = backward(k, held=(o,))  # the wrapper holds the forward's output
        local["output_tensor"] = None if last_v(chunk(fk, True)) else o
        local["input_tensor_grad"] = None if first_v(chunk(k, False)) else ig
        recv_next, nxt_b = receives(k, False)
        og = _Ref("og") if recv_next else None
        if overlap_p2p_comm:  # the buffers are emptied once appended; no local is assigned
            local["output_tensor_grad"] = None
        else:
            local["input_tensor"] = _Ref("in") if recv_prev else None
            local["output_tensor_grad"] = og
            if recv_prev:
                inputs[nxt_f].append(local["input_tensor"])
        if local["output_tensor"] is not None:
            local["output_tensor"].deallocated = True
        if recv_next:
            grads[nxt_b].append(og)
    if all_warmup:
        grads[vpp - 1].append(_Ref("og"))
    for k in range(steady, total):
        c = chunk(k, False)
        recv, nxt = receives(k, False)
        recv = recv and k != total - 1
        ig = backward(k)
        local["input_tensor_grad"] = None if first_v(c) else ig
        local["output_tensor_grad"] = _Ref("og") if recv else None
        if recv:
            grads[nxt].append(local["output_tensor_grad"])
    return out


def interleaved_references(pp: int, vpp: int, num_microbatches: int, rank: int,
                           hidden: int, overlap_p2p_comm: bool = False
                           ) -> list[tuple[str, dict[str, int]]]:
    """``interleaved_reference_tensors`` summed per kind: per step, kind -> bytes."""
    out = []
    for step, tensors in interleaved_reference_tensors(pp, vpp, num_microbatches, rank,
                                                       hidden, overlap_p2p_comm):
        rows: dict[str, int] = {}
        for kind, nbytes in tensors:
            rows[kind] = rows.get(kind, 0) + nbytes
        out.append((step, rows))
    return out
