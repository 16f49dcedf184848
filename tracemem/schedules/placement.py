"""Which model chunk (virtual stage) runs on which pipeline rank: the one table every other
module reads (``build_rank``, the dependency check, the replay, the parameter multiple).

Three styles, named as in PyTorch (torch/distributed/pipelining/_utils.py,
``generate_stage_to_rank_mapping``, torch 2.13) and DeepSeek's DualPipe:

- ``loop``: ``pp * vpp`` chunks; chunk ``v`` on rank ``v % pp`` (1F1B, GPipe, ZB-H1,
  Megatron's interleaved 1F1B).
- ``v``: ``2 * pp`` chunks; chunk ``v`` on rank ``v`` going down and ``2 * pp - 1 - v`` coming
  back, so rank 0 holds the first and the last chunk (ZB-V, DualPipeV).
- ``bidirectional``: ``pp`` chunks, each on two ranks: microbatches of the first half enter at
  rank 0 and run chunk ``s`` on rank ``s``, those of the second half enter at rank ``pp - 1``
  and run chunk ``s`` on rank ``pp - 1 - s`` (DualPipe, deepseek-ai/DualPipe dualpipe.py,
  ``DualPipe.step``: ``scatter(inputs, half_num_chunks)`` on the first and the last rank).
  Every rank holds two chunks, ``r`` and ``pp - 1 - r``: two stages' parameters.

A step's ``stage`` is always the model chunk; every microbatch passes chunks 0, 1, ... in
order, whatever the placement.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "STYLES"]

STYLES = ("loop", "v", "bidirectional")


@dataclass(frozen=True)
class Placement:
    """``style`` (one of ``STYLES``) of ``num_chunks`` model chunks on ``pp`` ranks;
    ``num_microbatches`` decides the direction of each microbatch under ``bidirectional``."""

    style: str
    pp: int
    num_chunks: int
    num_microbatches: int = 0

    def __post_init__(self) -> None:
        assert self.style in STYLES, self.style
        expected = {"loop": self.num_chunks, "v": 2 * self.pp,
                    "bidirectional": self.pp}[self.style]
        assert self.num_chunks == expected and self.num_chunks % self.pp == 0, \
            (self.style, self.pp, self.num_chunks)

    def direction(self, microbatch: int) -> int:
        """0 for microbatches entering at rank 0; 1 for the second half under
        ``bidirectional``."""
        if self.style != "bidirectional":
            return 0
        return int(microbatch >= self.num_microbatches // 2)

    def rank_of(self, chunk: int, microbatch: int = 0) -> int:
        """The rank that runs ``chunk`` for ``microbatch``."""
        if self.style == "loop":
            return chunk % self.pp
        if self.style == "v":
            return chunk if chunk < self.pp else 2 * self.pp - 1 - chunk
        return chunk if self.direction(microbatch) == 0 else self.pp - 1 - chunk

    def chunks_of(self, rank: int) -> list[int]:
        """The model chunks rank ``rank`` holds, in model order (the order of
        ``Transformer.chunks``: the first holds the embedding on the first stage, the last the
        head and loss on the last)."""
        if self.style == "loop":
            return list(range(rank, self.num_chunks, self.pp))
        if self.style == "v":
            return [rank, 2 * self.pp - 1 - rank]
        return sorted({rank, self.pp - 1 - rank})

    def chunk_index(self, rank: int, chunk: int) -> int:
        """The position of ``chunk`` among ``chunks_of(rank)``."""
        return self.chunks_of(rank).index(chunk)

    def copies(self, chunk: int) -> int:
        """How many ranks hold ``chunk``'s parameters (2 under ``bidirectional``: DualPipe's
        "2x" parameters, DeepSeek-V3 report Table 2)."""
        return 2 if self.style == "bidirectional" else 1
