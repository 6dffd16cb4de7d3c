"""The Pallas kernels' tuning defaults, in one frozen dataclass (a leaf: every kernel and the
kernel switch import it). Drivers pass a modified copy; nothing patches module globals."""

from __future__ import annotations

import dataclasses

import jax

TREE_LAUNCH_NAMES = ("block_t", "block_k", "num_splits", "num_warps", "num_stages")
DEFAULT_SM_COUNT = 132  # H100 / H200, for devices that do not report their core count


@dataclasses.dataclass(frozen=True)
class KernelTuning:
  """Tuning defaults of the Pallas kernels (fitted on an H200: docs/findings/)."""
  # SMs the attention's split-K rule fills; None: the device's count (DEFAULT_SM_COUNT if unknown)
  sm_count: int | None = None
  # tree_attention launch parameters (TREE_LAUNCH_NAMES) that replace the rule's for trees,
  # i.e. more than 64 query rows (tokens x GQA group) per kv head; () keeps the rule
  tree_launch: tuple[tuple[str, int], ...] = ()
  # a fused q/k/v projection runs as this many explicit split-K slices, summed by the q/k
  # kernel, at token rows (batch x nodes) in this inclusive range; XLA's GEMM elsewhere
  qkv_splits: int = 2
  qkv_rows: tuple[int, int] = (32, 128)
  # the residual add + RMSNorm kernel after o and down: token rows it runs at (inclusive;
  # an empty range turns it off), its split-K slices as (least contracted dim, slices), first
  # match, halved until they divide the dim and are at least residual_min_depth deep; warps
  residual_rows: tuple[int, int] = (64, 128)
  residual_splits: tuple[tuple[int, int], ...] = ((8192, 8), (0, 4))
  residual_min_depth: int = 512
  residual_warps: int = 8
  # the MoE expert GEMMs (`pallas.grouped_gemm`): (most (row, expert) pairs, block_m, block_n,
  # block_k), the first entry covering a step's pairs; XLA's ragged_dot past the last entry
  moe_launch: tuple[tuple[int, int, int, int], ...] = ((256, 16, 64, 128), (4096, 16, 128, 64),
                                                       (1 << 30, 64, 128, 64))
  # steps of at most moe_pair_max (row, expert) pairs run pair by pair, one tile each
  # (`grouped_gemm.pair_matmul`: no sort, no tile list), tiles (block_m, block_n, block_k)
  moe_pair_max: int = 64
  # the same bound for quantized stacks, whose grouped kernel overtakes the pair kernel sooner
  # (docs/findings/quantized-experts.md)
  moe_quant_pair_max: int = 8
  moe_pair_blocks: tuple[int, int, int] = (16, 64, 256)
  # steps of at most moe_decode_max (row, expert) pairs (moe_decode_quant_max for quantized
  # stacks) run `pallas.moe_decode`: the top-k inside the gate/up pair kernel, whose programs
  # are (I columns, block_k, warps) as moe_decode_launch (float stacks) or
  # moe_decode_quant_launch, then the down pair kernel at moe_pair_blocks (a max of 0: XLA's
  # routing, then the pair kernels)
  moe_decode_max: int = 64
  moe_decode_quant_max: int = 8
  moe_decode_launch: tuple[int, int, int] = (64, 128, 4)
  moe_decode_quant_launch: tuple[int, int, int] = (64, 256, 4)
  # the gate/up kernel's I columns per program spread so that pairs x programs fills about
  # the SM count (`moe_decode.fill_span`, load width at most the launch's); False: the launch's
  # width per program
  moe_decode_fill: bool = True
  # the same for the down kernel's H columns, loads at most this wide (0: moe_pair_blocks' as
  # they are)
  moe_down_fill_width: int = 128
  # the decode router (`moe_glue.router_partials`): (slices of H, experts per program, H rows
  # per K step, warps); 0 slices: XLA's router
  moe_router_launch: tuple[int, int, int, int] = (8, 32, 64, 4)
  # quantized expert stacks (`pallas.quant_gemm`): the dequantized weights as the dot's left
  # operand (swap: the tile computed transposed) or its right one, as the float kernels
  moe_quant_swap: bool = False
  # latent attention (MLA) on the Pallas kernel (`pallas.latent_attention`; one device, power-of-
  # two latent and RoPE widths) for one token, or up to latent_tree_rows query rows (tokens x
  # heads) over a cache of up to latent_tree_capacity rows; XLA's form elsewhere (the limits lie
  # between measured faster and slower points: docs/findings/latent-attention-and-deepseekmoe.md).
  # The valid prefix is cut into capacity // latent_split_rows splits (1 to latent_max_splits),
  # launched as latent_launch (block_q, block_k, num_warps, num_stages;
  # blocks powers of two >= 16). latent_pallas False: XLA's form always
  latent_pallas: bool = True
  latent_tree_rows: int = 512
  latent_tree_capacity: int = 2048
  latent_split_rows: int = 128
  latent_max_splits: int = 64
  latent_launch: tuple[int, int, int, int] = (16, 64, 4, 2)
  # a Gated DeltaNet layer's tree rule (`pallas.delta_tree`): (value columns per program, warps);
  # trees of more nodes keep XLA's form (a program holds N x N float32 matrices in registers:
  # measured up to 33 nodes, padded to 64)
  delta_tree_launch: tuple[int, int] = (64, 4)
  delta_tree_max_nodes: int = 64
  # Pallas interpret mode; None: on a CPU backend (False lowers to Triton there, for an
  # abstract GPU: experiments/perf/compile_offline.py)
  interpret: bool | None = None

  def __post_init__(self):
    bad = [k for k, _ in self.tree_launch if k not in TREE_LAUNCH_NAMES]
    if bad:
      raise ValueError(f"KernelTuning.tree_launch: unknown names {bad}; valid: "
                       f"{TREE_LAUNCH_NAMES}")
    if self.sm_count is not None and self.sm_count < 1:
      raise ValueError(f"KernelTuning.sm_count must be >= 1 or None, got {self.sm_count}")
    if self.qkv_splits < 0 or self.residual_warps < 1 or self.residual_min_depth < 1:
      raise ValueError(f"KernelTuning: qkv_splits >= 0, residual_warps >= 1 and "
                       f"residual_min_depth >= 1 needed, got {self}")
    block_q, block_k, warps, stages = self.latent_launch
    if (min(self.latent_split_rows, self.latent_max_splits, warps, stages) < 1
        or any(x < 16 or x & (x - 1) for x in (block_q, block_k))):
      raise ValueError(f"KernelTuning: latent_split_rows, latent_max_splits, warps and stages "
                       f">= 1 and latent blocks powers of two >= 16 needed, got split rows "
                       f"{self.latent_split_rows}, max splits {self.latent_max_splits}, launch "
                       f"{self.latent_launch}")

  def use_latent_pallas(self, tokens: int, heads: int, capacity: int) -> bool:
    """Whether latent attention of `tokens` new rows x `heads` over a cache of `capacity` rows
    runs on the Pallas kernel (one device)."""
    return self.latent_pallas and (tokens == 1 or (tokens * heads <= self.latent_tree_rows and
                                                   capacity <= self.latent_tree_capacity))

  def device_sm_count(self) -> int:
    """The SM count the attention's split rule fills."""
    if self.sm_count:
      return self.sm_count
    try:
      return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SM_COUNT
    except RuntimeError:  # no backend
      return DEFAULT_SM_COUNT

  def moe_blocks(self, pairs: int) -> tuple[int, int, int] | None:
    """(block_m, block_n, block_k) of the grouped GEMM over `pairs` sorted rows, or None (XLA's
    ragged_dot)."""
    return next((tuple(b) for most, *b in self.moe_launch if pairs <= most), None)

  def qkv_split_count(self, rows: int) -> int:
    """Split-K slices of a fused q/k/v projection over `rows` token rows (0: XLA's GEMM)."""
    lo, hi = self.qkv_rows
    return self.qkv_splits if lo <= rows <= hi else 0

  def residual_split_count(self, rows: int, contracted: int) -> int:
    """Split-K slices of a [rows, contracted] o / down projection for the residual kernel (0:
    XLA's form)."""
    lo, hi = self.residual_rows
    if not lo <= rows <= hi:
      return 0
    s = next((s for least, s in self.residual_splits if contracted >= least), 0)
    while s > 1 and (contracted % s or contracted // s < self.residual_min_depth):
      s //= 2
    return s if s > 1 else 0
