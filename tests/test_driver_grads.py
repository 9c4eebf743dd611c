"""The AdamDriver's accumulated gradient kept in 16 bits (no gradient accumulation): stored values, norms, and a
second backward without a step."""
from __future__ import annotations

import torch

from zero.optim.driver import AdamDriver

from conftest import PAGE  # noqa: F401  (make_manager: the fixture, from conftest)


def test_a_16_bit_gradient_holds_the_reduced_values_and_a_second_add_is_summed_in_fp32(make_manager):
    mgr = make_manager(host_budget=256 * PAGE)
    driver = AdamDriver(mgr, state_home="host", grad_home="host", work_tier="host", grad_dtype=torch.bfloat16)
    try:
        (sg,) = driver.add_unit(0, "u", torch.zeros(1000), group=0, chunk=0)
        first = torch.randn(1000, generator=torch.Generator().manual_seed(0)).bfloat16().float()
        second = torch.randn(1000, generator=torch.Generator().manual_seed(1)).bfloat16().float()
        driver.accumulate(sg, first, [(0, 1000, 0)])
        with driver.held(sg, "grad") as grad:
            assert grad.dtype == torch.bfloat16 and torch.equal(grad.float(), first)  # exact: it came from bf16
        assert torch.equal(sg.norms[0][1], torch.linalg.vector_norm(first))  # the fp32 values' norm
        driver.accumulate(sg, second, [(0, 1000, 0)])
        total = (first + second).bfloat16()  # summed in fp32, rounded once
        with driver.held(sg, "grad") as grad:
            assert torch.equal(grad, total)
        assert torch.equal(sg.norms[0][1], torch.linalg.vector_norm(total.float()))  # of what the step reads
    finally:
        driver.close()
