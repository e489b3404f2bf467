"""The same model at a scale no laptop reaches: published runs on H100 and A100 clusters, predicted.

A laptop's constants are measured (:mod:`pcourse.tools.bench.calibrate`); a cluster's are
read from datasheets (:class:`GPU`, each value with its source). What a datasheet cannot
say is how close real kernels come to the peak: **one efficiency factor per GPU kind**,
fitted on one named published point (:func:`fit_efficiency`); every other point is a
prediction, printed beside the published figure with its error (lesson 13).

Two sources:

- **torchtitan** (``pytorch/torchtitan``, ``benchmarks/llama3_h100_202412_torchtitan.md``,
  Tables 1 and 3): Llama 3.1 8B under FSDP on 8 and on 128 H100, bf16, local batch 2 of
  8,192 tokens, selective activation checkpointing: tokens/s per GPU and memory.
  :func:`fsdp_step`, :func:`fsdp_memory`: the step computes its tokens' FLOPs (6 per
  parameter and token, plus attention: torchtitan's own count) at the fitted fraction of
  the peak, while the all-gathers (bf16, forward and backward) and the reduce-scatter
  (fp32) run beside it, prefetched: the longer of the two. Memory: lesson 10's fully
  sharded state, 16 bytes per parameter over N, two gathered bf16 layers, and the
  activations selective recomputation keeps, Korthikanti et al.'s 34·s·b·h bytes per
  layer (arXiv:2205.05198, Table 2).
- **Megatron-LM** (Narayanan et al., SC'21, arXiv:2104.04473, Table 1): GPT models of
  1.7B to 1T parameters on 32 to 3,072 A100, tensor × pipeline × data parallel, full
  recomputation: achieved teraFLOP/s per GPU, from the paper's own FLOP count (its
  Eq. 3). :func:`ptdp_step`: the pipeline's (m + p - 1) micro-batch slots (lesson 12's
  bubble), each a micro-batch's FLOPs on a stage at the fitted fraction of the peak
  plus its tensor-parallel allreduces over NVLink (lesson 11: two forward, two in the
  recomputed forward, two backward per layer), then the data-parallel allreduce of the
  stage's fp32 gradients across nodes (lesson 03's ring), after the pipeline drains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pcourse.collectives import cost_terms
from pcourse.cost_model.compare import error
from pcourse.cost_model.machine import CostModelError
from pcourse.pipeline import bubble_fraction

GiB = 1 << 30


@dataclass(frozen=True)
class GPU:
    """A GPU kind from its datasheet: dense bf16 FLOP/s, memory (bytes), NVLink bytes/s
    one way per GPU, the network's bytes/s per GPU across nodes, GPUs per node."""

    name: str
    flops: float
    memory: float
    nvlink: float
    network: float
    per_node: int
    source: str


H100 = GPU("H100 SXM (torchtitan's Grand Teton hosts)", 989e12, 96e9, 450e9, 50e9, 8,
           "NVIDIA H100 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), "
           "NVLink 900 GB/s (450 each way); torchtitan's benchmark: 96 GB HBM2e per GPU, "
           "8 GPUs per host on NVLink, RDMA 400 Gb/s per GPU")
A100 = GPU("A100 SXM 80GB (Selene, DGX A100)", 312e12, 80e9, 300e9, 25e9, 8,
           "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense, NVLink 600 GB/s "
           "(300 each way), 80 GB; Narayanan et al. SC'21 section 5: 8 HDR InfiniBand "
           "HCAs of 200 Gb/s per 8-GPU node")


@dataclass(frozen=True)
class LLM:
    """A decoder-only transformer as the sources describe it."""

    name: str
    params: float  # all of them
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    embedding: float = 0.0  # parameters outside the layers' products (torchtitan's count)

    def flops_per_token(self) -> float:
        """torchtitan's count: 6 per non-embedding parameter, plus 12·layers·hidden·seq."""
        return 6 * (self.params - self.embedding) + 12 * self.layers * self.hidden * self.seq

    def megatron_flops(self, batch: int) -> float:
        """Narayanan et al.'s Eq. 3: one iteration's FLOPs with full recomputation,
        96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
        b, s, n, h, v = batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


LLAMA_8B = LLM("Llama 3.1 8B", 8.03e9, 32, 4096, 32, 128256, 8192, embedding=128256 * 4096)


def ring(kind: str, n: int, nbytes: float, bandwidth: float) -> float:
    """Seconds of a bandwidth-bound ring collective of ``nbytes`` over n GPUs (lesson 03:
    an allreduce carries 2(n-1)/n of the data on each link, each half (n-1)/n)."""
    if kind not in ("allreduce", "half"):
        raise CostModelError(f"ring kind {kind!r}: 'allreduce' or 'half'")
    volume = cost_terms("ring", n)[1] / (2 if kind == "half" else 1)
    return volume * nbytes / bandwidth


def link(gpu: GPU, n: int) -> float:
    """Bytes/s of a ring over n GPUs: NVLink within a node, the network beyond it."""
    return gpu.nvlink if n <= gpu.per_node else gpu.network


# ------------------------------------------------------------------ torchtitan's FSDP
def fsdp_step(model: LLM, gpu: GPU, n: int, local_batch: int, efficiency: float) -> float:
    """Seconds of one FSDP step on each of n GPUs: compute, or the prefetched
    collectives (two bf16 all-gathers and one fp32 reduce-scatter of the parameters),
    whichever takes longer."""
    compute = local_batch * model.seq * model.flops_per_token() / (gpu.flops * efficiency)
    wire = ring("half", n, (2 + 2 + 4) * model.params, link(gpu, n))
    return max(compute, wire)


def fsdp_tokens_per_gpu(model: LLM, gpu: GPU, n: int, local_batch: int,
                        efficiency: float) -> float:
    return local_batch * model.seq / fsdp_step(model, gpu, n, local_batch, efficiency)


def fsdp_memory(model: LLM, n: int, local_batch: int) -> float:
    """Bytes per GPU: 16Ψ/n of fp32 state (lesson 10), two gathered bf16 layers, and
    selective recomputation's activations, 34 bytes per token, hidden unit and layer."""
    layer = (model.params - model.embedding) / model.layers
    activations = 34 * model.seq * local_batch * model.hidden * model.layers
    return 16 * model.params / n + 2 * 2 * layer + activations


# ------------------------------------------------------------------ Megatron's PTD-P
@dataclass(frozen=True)
class Mesh:
    """Tensor × pipeline × data parallel sizes, the global batch, micro-batch size 1."""

    tp: int
    pp: int
    gpus: int
    batch: int

    @property
    def dp(self) -> int:
        if self.gpus % (self.tp * self.pp):
            raise CostModelError(f"{self.gpus} GPUs do not divide into tp = {self.tp} × "
                                 f"pp = {self.pp}")
        return self.gpus // (self.tp * self.pp)

    @property
    def micro(self) -> int:
        if self.batch % self.dp:
            raise CostModelError(f"the batch ({self.batch}) does not divide by dp = {self.dp}")
        return self.batch // self.dp


def ptdp_step(model: LLM, gpu: GPU, mesh: Mesh, efficiency: float) -> float:
    """Seconds of one iteration: (m + p - 1) slots of one micro-batch per stage (its
    share of the FLOPs, and six tensor-parallel allreduces per layer of its
    activation), then the data-parallel allreduce of the stage's fp32 gradients."""
    m = mesh.micro
    per_micro = model.megatron_flops(1) / (mesh.tp * mesh.pp) / (gpu.flops * efficiency)
    activation = model.seq * model.hidden * 2  # one sample, bf16
    tp_comm = 6 * (model.layers / mesh.pp) * ring("allreduce", mesh.tp, activation,
                                                 link(gpu, mesh.tp))
    slots = m / (1 - bubble_fraction(mesh.pp, m))  # m + p - 1: lesson 12
    grads = 4 * model.params / (mesh.tp * mesh.pp)
    dp_comm = ring("allreduce", mesh.dp, grads, link(gpu, mesh.dp * gpu.per_node))
    return slots * (per_micro + tp_comm) + dp_comm


def ptdp_memory(model: LLM, mesh: Mesh) -> float:
    """Bytes on the first stage's GPUs: 18 per parameter of its share (bf16 weights, fp32
    main weights and gradients, Adam's two fp32 states: no optimizer sharding, as in the
    paper) and, under full recomputation, each layer's bf16 input for the p micro-batches
    1F1B keeps in flight there (lesson 12)."""
    state = 18 * model.params / (mesh.tp * mesh.pp)
    inputs = 2 * model.seq * model.hidden * (model.layers / mesh.pp) * min(mesh.pp, mesh.micro)
    return state + inputs


def choose_mesh(model: LLM, gpu: GPU, gpus: int, batch: int, efficiency: float
                ) -> list[dict]:
    """Every (tp, pp) that divides the GPUs and the layers, with its memory per GPU,
    whether it fits, and its predicted FLOP/s per GPU; the best that fits first."""
    rows = []
    for tp in (1, 2, 4, 8, 16):
        for pp in range(1, model.layers + 1):
            if gpus % (tp * pp) or model.layers % pp or batch % (gpus // (tp * pp)):
                continue
            mesh = Mesh(tp, pp, gpus, batch)
            memory = ptdp_memory(model, mesh)
            rows.append({"tp": tp, "pp": pp, "dp": mesh.dp, "memory": memory,
                         "fits": memory <= gpu.memory,
                         "tflops": ptdp_tflops(model, gpu, mesh, efficiency) / 1e12})
    return sorted(rows, key=lambda r: (not r["fits"], -r["tflops"]))


def ptdp_tflops(model: LLM, gpu: GPU, mesh: Mesh, efficiency: float) -> float:
    """Achieved FLOP/s per GPU as the paper counts them (Eq. 3 over the iteration)."""
    return model.megatron_flops(mesh.batch) / (ptdp_step(model, gpu, mesh, efficiency)
                                               * mesh.gpus)


# ------------------------------------------------------------------ the published points
@dataclass(frozen=True)
class Point:
    """One published figure: what it measures, the source, and how to predict it from
    an efficiency (``predict(e)``), in the figure's own unit."""

    name: str
    unit: str
    published: float
    source: str
    predict: Callable[[float], float]
    kind: str  # "time" (a throughput) or "memory"


def torchtitan_points() -> list[Point]:
    src = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table {}"
    out = []
    # Each lambda binds the loop's values as defaults; mypy cannot infer such a lambda as
    # the Callable[[float], float] it is (hence the ignores).
    for n, tps, gib, table in ((8, 5762, 82.4, 1), (128, 5605, 67.0, 3)):
        out.append(Point(f"Llama 3.1 8B FSDP, {n} H100: tokens/s per GPU", "tokens/s", tps,
                         src.format(table),
                         lambda e, n=n: fsdp_tokens_per_gpu(  # type: ignore[misc]
                             LLAMA_8B, H100, n, 2, e), "time"))
        out.append(Point(f"Llama 3.1 8B FSDP, {n} H100: memory", "GiB", gib, src.format(table),
                         lambda e, n=n: fsdp_memory(LLAMA_8B, n, 2) / GiB,  # type: ignore[misc]
                         "memory"))
    return out


MEGATRON_TABLE = (  # params (B), heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163))


def megatron_points() -> list[Point]:
    out = []  # the lambda binds the loop's values as defaults: see torchtitan_points
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE:
        model = LLM(f"GPT {params}B", params * 1e9, layers, hidden, heads, 51200, 2048)
        mesh = Mesh(tp, pp, gpus, batch)
        out.append(Point(f"GPT {params}B, t={tp} p={pp} d={mesh.dp}, {gpus} A100: TFLOP/s "
                         "per GPU", "TFLOP/s", tflops,
                         "Narayanan et al. SC'21 (arXiv:2104.04473), Table 1",
                         lambda e, m=model, x=mesh: (  # type: ignore[misc]
                             ptdp_tflops(m, A100, x, e) / 1e12), "time"))
    return out


def fit_efficiency(point: Point) -> float:
    """The efficiency at which ``point``'s prediction equals its published figure
    (bisection: every prediction here grows with the efficiency)."""
    lo, hi = 1e-3, 1.0
    if point.predict(hi) < point.published:
        raise CostModelError(f"{point.name}: even the full peak predicts less than published")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if point.predict(mid) < point.published else (lo, mid)
    return (lo + hi) / 2


def table(points: list[Point], calibration: Point) -> list[dict]:
    """Every point predicted with the efficiency fitted on ``calibration`` (memory
    needs none): prediction, published figure, error."""
    e = fit_efficiency(calibration)
    return [{"point": p.name, "unit": p.unit, "predicted": p.predict(e),
             "published": p.published, "error": error(p.predict(e), p.published),
             "kind": p.kind, "source": p.source, "fitted": p is calibration, "efficiency": e}
            for p in points]
