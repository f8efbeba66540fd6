"""The grammar bitmask applied to the logits in one pass: the Triton provider of
``cllm::apply_token_bitmask`` (providers.py), which the sampler picks through the kernel registry.

Under structured output it runs every decode step, on rows of the model's whole vocabulary
(151,936 logits a Qwen2.5 row). The torch reference unpacks the mask into a [S, 32 W] tensor,
then a boolean [S, V] one, then fills: several passes and allocations (~11 µs at one row, ~630 µs
at 512 on an H200). Here each program takes BLOCK tokens of one row: it loads their BLOCK / 32
mask words, tests each token's bit and writes -inf over the disallowed ones only. The logits are
never read and allowed ones never written; programs share nothing, so there is no reduction and
no atomic. The grid is (rows, vocabulary blocks): ~1.4 µs at one row, ~52 µs at 512 rows of a
mask that allows a few hundred tokens (~3 TB/s of writes), ~25 µs where it allows nearly all
(H200, bf16, kernel time). 4096 tokens a program measured best on such masks; 1024 does better
on a random half-allowed mask (~90 µs against ~110 at 512 rows), which grammars do not make;
both take ~1.4 µs at one row.

Nothing in the launch follows the batch size but the grid, and the integer arguments are left
unspecialised (do_not_specialize): one compiled kernel per logits dtype (and pointer alignment) serves every batch
size, vocabulary and mask width, so serving never compiles in the middle of a run once the
build's kernel warm-up has launched it (serve/kernel_warmup.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiled_llm.graph.ops import check_token_bitmask

BLOCK_V = 4096  # tokens a program; 128 mask words
NUM_WARPS = 4


# The column strides stay specialised: 1, as they nearly always are, compiles to contiguous
# addresses; any other stride is a variant of its own.
@triton.jit(do_not_specialize=["V", "stride_l", "W", "stride_b"])
def _bitmask_kernel(logits_ptr, bitmask_ptr, V, stride_l, stride_lv, W, stride_b, stride_bw, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    WORDS: tl.constexpr = BLOCK // 32
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    # words past the mask read as 0: the tokens past 32 W are disallowed
    words = tl.load(bitmask_ptr + row * stride_b + word * stride_bw, mask=word < W, other=0)
    bit = tl.arange(0, 32)
    token = word[:, None] * 32 + bit[None, :]  # [WORDS, 32]
    disallowed = ((words[:, None] >> bit[None, :]) & 1) == 0  # & 1: the shift of a negative word extends its sign
    neg_inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + token * stride_lv, neg_inf, mask=disallowed & (token < V))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of logits [S, V] (any float dtype, any strides) whose
    token the row's bitmask [S, W] (int32, xgrammar's layout) disallows; tokens past 32 W are
    disallowed. See ``ops.apply_token_bitmask_ref``."""
    check_token_bitmask(logits, bitmask)
    S, V = logits.shape
    if S == 0 or V == 0:
        return
    _bitmask_kernel[(S, triton.cdiv(V, BLOCK_V))](
        logits, bitmask, V, *logits.stride(), bitmask.shape[1], *bitmask.stride(), BLOCK=BLOCK_V, num_warps=NUM_WARPS,
    )
