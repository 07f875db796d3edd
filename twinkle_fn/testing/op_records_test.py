import torch

from twinkle_fn.testing.op_records import op_shapes


def test_records_the_outputs_of_the_one_op_in_order():
    x = torch.ones(3, 4, requires_grad=True)
    y = (x * 2.0).sum(0) * x.new_ones(4)
    with op_shapes(torch.ops.aten.mul) as shapes:
        y.backward(torch.ones(4))
    assert shapes == [(4,), (3, 4)]  # the [4] gradient, then the [3, 4] one
    with op_shapes(torch.ops.aten.add) as none:
        torch.ones(2) * 3
    assert none == []
