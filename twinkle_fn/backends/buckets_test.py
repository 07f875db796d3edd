import pytest
import torch

from twinkle_fn.backends.buckets import buckets, nbytes, persistent_buffers


def test_buckets_respect_the_bound_and_keep_order():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([3, 1, 4, 1, 5, 9, 2, 6])]
    out = list(buckets(named, 6 * 4))  # six float32 elements
    assert [n for b in out for n, _ in b] == [n for n, _ in named]
    # The 9-element tensor exceeds the bound and goes alone; every other bucket fits.
    assert [[n for n, _ in b] for b in out] == [
        ["t0", "t1"],
        ["t2", "t3"],
        ["t4"],
        ["t5"],
        ["t6"],
        ["t7"],
    ]
    assert all(sum(nbytes(t) for _, t in b) <= 24 or len(b) == 1 for b in out)


def test_buckets_are_lazy():
    pulled = []

    def named():
        for i in range(4):
            pulled.append(i)
            yield f"t{i}", torch.zeros(2)

    it = buckets(named(), 8)  # one two-element float32 tensor per bucket
    assert next(it)[0][0] == "t0" and pulled == [0, 1]


def test_nbytes_counts_elements_not_storage():
    assert nbytes(torch.zeros(10, dtype=torch.bfloat16)[2:5]) == 6


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_buckets_refuse_a_bad_bound(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        buckets([], bad)


def test_persistent_buffers_are_the_state_dicts_buffers():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    module[0].register_buffer("scratch", torch.zeros(2), persistent=False)
    module[0].register_buffer("bias_of_choice", torch.ones(2))
    got = persistent_buffers(module)
    params = {n for n, _ in module.named_parameters()}
    assert got.keys() == module.state_dict().keys() - params
    assert got["0.bias_of_choice"] is module[0].bias_of_choice
