"""A stack of the course's transformer blocks, described by its sizes (lesson 13).

:class:`Stack` is ``layers`` of :class:`pcourse.workloads.transformer.Block` (width d,
``heads`` heads, an MLP of ``hidden``) on activations ``[seq, batch, d]`` of
``itemsize``-byte numbers: the model lessons 11 and 12 split and lesson 13 trains under
every strategy. From the sizes alone it says how many parameters a rank holds and how
many bytes autograd saves for the backward, block by block, for a tensor-parallel
degree t, with or without sequence parallelism, and under each activation-checkpointing
policy. Counted against ``count_saved`` (lesson 11) and the allocator, not estimated.

Per block, in units of U = seq·batch·d·itemsize bytes (lesson 11's table, whose
t = 1 column is ``none``):

- ``none``: the block's input and the attention's residual (2U; 2U/t sequence-parallel),
  the two norms' outputs (2U, gathered), q, k, v and the heads' output (4U/t), the
  MLP's two hidden activations (2U·hidden/d/t), and the statistics: each norm's mean
  and reciprocal deviation (seq·batch numbers each, per the rank's part of the
  sequence) and attention's log-sum-exp (batch·heads/t·seq numbers);
- ``full``: the block's input only (U; U/t sequence-parallel): the rest is recomputed
  (torch's ``checkpoint`` keeps the random-number state besides, outside these hooks);
- ``selective`` (torch's selective checkpointing, products saved, the rest recomputed;
  t = 1): the input, the outputs of the six products (q, k, v, o: U each; the MLP's
  U·hidden/d and U), attention's output and log-sum-exp, and the random-number state
  torch keeps to replay the block.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcourse.cost_model.machine import CostModelError

POLICIES = ("none", "full", "selective")
RNG_STATE_BYTES = 5056  # torch.get_rng_state().numel(): what torch.utils.checkpoint keeps


@dataclass(frozen=True)
class Stack:
    """``layers`` blocks of width ``d`` on ``[seq, batch, d]`` activations."""

    layers: int
    d: int
    heads: int
    hidden: int
    seq: int
    batch: int
    itemsize: int = 4

    def __post_init__(self) -> None:
        for name in ("layers", "d", "heads", "hidden", "seq", "batch", "itemsize"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"{name} = {value!r}: a whole number of at least 1")
        if self.d % self.heads:
            raise CostModelError(f"d = {self.d} does not divide by heads = {self.heads}")

    # ------------------------------------------------------------------ parameters
    def block_params(self) -> int:
        """Parameters of one block: q, k, v, o (d×d + d each), the MLP, two norms."""
        d, h = self.d, self.hidden
        return 4 * (d * d + d) + (d * h + h) + (h * d + d) + 4 * d

    def block_params_whole(self) -> int:
        """Parameters tensor parallelism leaves whole on every rank: the two norms and
        the two row-parallel biases (lesson 11)."""
        return 4 * self.d + 2 * self.d

    def params(self, t: int = 1) -> int:
        """Parameters one rank holds with the blocks split over t ranks (lesson 11)."""
        self.check_split(t)
        whole = self.block_params_whole()
        return self.layers * ((self.block_params() - whole) // t + whole)

    def check_split(self, t: int, sp: bool = False) -> None:
        """Refuse a tensor-parallel degree the block cannot be cut into."""
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise CostModelError(f"tensor-parallel degree t = {t!r}: a whole number >= 1")
        for name, n in (("heads", self.heads), ("hidden", self.hidden),
                        *((("seq", self.seq),) if sp else ())):
            if n % t:
                raise CostModelError(f"{name} = {n} does not divide by the tensor-parallel "
                                     f"degree t = {t}")

    # ----------------------------------------------------------------- activations
    def unit(self, batch: int | None = None) -> int:
        """U: bytes of one ``[seq, batch, d]`` activation."""
        return self.seq * (batch or self.batch) * self.d * self.itemsize

    def block_saved(self, *, t: int = 1, sp: bool = False, policy: str = "none",
                    batch: int | None = None) -> int:
        """Bytes one block saves for its backward on one rank (see the module docstring)."""
        self.check_split(t, sp)
        if policy not in POLICIES:
            raise CostModelError(f"unknown checkpointing policy {policy!r}; use one of "
                                 f"{', '.join(POLICIES)}")
        b = batch or self.batch
        u, size = self.unit(b), self.itemsize
        seq_here = self.seq // t if sp else self.seq
        if policy == "full":
            return u // t if sp else u
        lse = b * (self.heads // t) * self.seq * size
        if policy == "selective":
            if t != 1:
                raise CostModelError("the selective policy is modelled at t = 1 only")
            return 7 * u + u * self.hidden // self.d + lse + RNG_STATE_BYTES
        inputs = 2 * u // t + 2 * u if sp else 4 * u
        split = (4 * u + 2 * u * self.hidden // self.d) // t
        stats = 4 * seq_here * b * size
        return inputs + split + stats + lse

    def saved(self, *, t: int = 1, sp: bool = False, policy: str = "none",
              batch: int | None = None, layers: int | None = None) -> int:
        """Bytes ``layers`` blocks (default: all) save, plus the loss's (the square's
        input, the stack's output)."""
        n = self.layers if layers is None else layers
        out = self.unit(batch) // (t if sp else 1)
        return n * self.block_saved(t=t, sp=sp, policy=policy, batch=batch) + out

    # ------------------------------------------------------------------------ FLOPs
    def block_weights(self) -> int:
        """The entries of one block's weight matrices: what its products multiply by."""
        return 4 * self.d * self.d + 2 * self.d * self.hidden

    def flops_per_token(self) -> int:
        """Training FLOPs per token of the products, no recomputation: 6 per weight (2
        forward, 4 backward) plus attention's scores and weighted sum, 12·d·seq per layer
        (4·d·seq forward, twice that backward): the convention torchtitan's MFU uses,
        and what torch's FLOP table counts for these operators."""
        return self.layers * (6 * self.block_weights() + 12 * self.d * self.seq)
