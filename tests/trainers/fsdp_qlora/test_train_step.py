"""The step's label-row cross-entropy against torch's own ``F.cross_entropy``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainers.fsdp_qlora.train_step import LabelCrossEntropySum


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
def test_label_cross_entropy_equals_torch_value_and_gradient(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 1000, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 1000, (37,), generator=gen)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    ours = LabelCrossEntropySum.apply(ours_in, targets)
    ref = F.cross_entropy(ref_in.float(), targets, reduction="sum")
    (ours * 0.37).backward()
    (ref * 0.37).backward()
    torch.testing.assert_close(ours, ref, rtol=tol, atol=0)
    assert ours_in.grad.dtype == dtype
    # Both gradients are computed in fp32 and rounded once to the logits' dtype.
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad.float(), rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 1e-2 * 0.37)

