"""The SFT loss: mean negative log-likelihood of the answer tokens only."""

import pytest
import torch

from forge.losses import sft_loss


def test_the_loss_is_the_mean_nll_of_masked_in_tokens_only():
    """Prompt and padding positions (mask 0, even -inf) do not count; answer tokens do, equally."""
    logprobs = torch.tensor([[-1.0, -2.0, float("-inf")], [-3.0, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss, stats = sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx((1 + 2 + 0.5 + 0.5) / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -mask.float() / 4)  # exact: quarters
    assert stats["nll"].item() == pytest.approx(loss.item())


def test_no_answer_token_gives_a_zero_loss_with_a_graph():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = sft_loss(logprobs, torch.zeros(2, 3))
    assert loss.item() == 0.0
    loss.backward()


def test_a_mask_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="mask has shape"):
        sft_loss(torch.zeros(2, 3), torch.zeros(2, 2))
