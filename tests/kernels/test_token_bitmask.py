"""cllm::apply_token_bitmask, the grammar mask of structured output, in xgrammar's layout: its
torch reference against a token-by-token reading of the bitmask (CPU; the Triton kernel is
checked against the reference under the interpreter, helpers/kernels_interpret_cases.py, and on
a GPU, test_kernels_gpu.py)."""

import pytest
import torch

from compiled_llm.graph import ops


def _allowed_token_by_token(bitmask: torch.Tensor, row: int, vocab: int) -> list[bool]:
    """Token v of ``row`` is allowed iff bit v % 32 of word v // 32 is set; no word, not allowed."""
    words = [w & 0xFFFFFFFF for w in bitmask[row].tolist()]
    return [v // 32 < len(words) and bool(words[v // 32] >> (v % 32) & 1) for v in range(vocab)]


def _bitmask(rows: list[list[int]]) -> torch.Tensor:
    """int32 words from unsigned 32-bit patterns (bit 31 set reads as a negative word)."""
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in r] for r in rows], dtype=torch.int32)


def test_disallowed_logits_become_minus_inf_in_place_and_allowed_ones_keep_their_value():
    vocab = 70  # three words, the last one partly past the vocabulary
    bitmask = _bitmask([
        [0x80000001, 0x00000000, 0xFFFFFFFF],  # tokens 0 and 31 (the sign bit), then 64..69
        [0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF],  # every token
        [0x00000000, 0x00010000, 0x00000000],  # token 48 only
    ])
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    assert ops.apply_token_bitmask_ref(logits, bitmask) is None
    for row in range(3):
        for v, allowed in enumerate(_allowed_token_by_token(bitmask, row, vocab)):
            assert logits[row, v].item() == (before[row, v].item() if allowed else float("-inf")), (row, v)
    assert torch.equal(logits[1], before[1])  # an all -1 row is left as it is


def test_tokens_past_a_mask_narrower_than_the_logits_are_disallowed():
    """A model vocabulary padded past the tokenizer's: the mask has no word for the padding."""
    logits = torch.zeros(2, 40)
    ops.apply_token_bitmask_ref(logits, _bitmask([[0xFFFFFFFF], [0x00000004]]))
    assert torch.isfinite(logits[0, :32]).all() and torch.isneginf(logits[0, 32:]).all()
    assert torch.isfinite(logits[1]).tolist() == [v == 2 for v in range(40)]


def test_the_op_masks_a_strided_view_of_bf16_logits_and_nothing_beside_it():
    table = torch.randn(2, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = table.clone()
    torch.ops.cllm.apply_token_bitmask(table[:, :40], _bitmask([[0x0000000F, 0x00000000], [0x00000000, 0x000000FF]]))
    assert torch.isfinite(table[0, :40]).tolist() == [v < 4 for v in range(40)]
    assert torch.isfinite(table[1, :40]).tolist() == [32 <= v < 40 for v in range(40)]
    assert torch.equal(table[:, 40:], before[:, 40:])
    assert torch.equal(table[0, :4], before[0, :4])


@pytest.mark.parametrize("bitmask, problem", [
    (torch.zeros(3, 2, dtype=torch.int32), "does not match logits"),
    (torch.zeros(2, 2, dtype=torch.int64), "want torch.int32"),
])
def test_a_bitmask_that_does_not_fit_the_logits_is_refused_with_a_clear_error(bitmask, problem):
    with pytest.raises(ValueError, match=problem):
        ops.apply_token_bitmask_ref(torch.zeros(2, 50), bitmask)
