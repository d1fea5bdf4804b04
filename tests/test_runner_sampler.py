"""The batched sampler: greedy, temperature, top-k and top-p masks, seeded reproducibility."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead on small CI machines

from kvsched.runner.sampler import apply_top_k_top_p, sample  # noqa: E402

NEG_INF = float("-inf")


def test_top_k_keeps_exactly_the_k_largest_per_row() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [9.0, 8.0, 7.0, 6.0, 5.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, True, False]
    assert torch.isfinite(masked[1]).all()  # top_k = 0 is off
    assert torch.equal(masked[0, [1, 3]], logits[0, [1, 3]])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.5, 0.25, 0.15, 0.1], [0.9, 0.05, 0.03, 0.02]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.7, 0.75, 0.5]))
    assert torch.isfinite(masked).tolist() == [
        [True, True, False, False],  # 0.5 < 0.7, 0.5 + 0.25 >= 0.7
        [True, True, False, False],  # exactly reaching p stops there
        [True, False, False, False],  # the top token alone is always kept
    ]


def test_top_k_and_top_p_combine() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.99]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False, False]]


def test_greedy_rows_take_the_argmax_and_others_sample() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    tokens = sample(logits, temperature)
    greedy = logits.argmax(-1)
    assert tokens[[0, 2, 4]].tolist() == greedy[[0, 2, 4]].tolist()


def test_sampled_tokens_stay_inside_the_top_k_set() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 100)
    tokens = sample(logits, torch.full((64,), 2.0), top_k=torch.full((64,), 3, dtype=torch.int64))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == tokens.unsqueeze(1)).any(dim=1).all()


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3).contiguous()
    tokens = sample(logits, torch.ones(20000))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    temperature = torch.ones(4)

    def run(batch_order: list[int]) -> dict[int, list[int]]:
        gens = {1: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}
        seq: dict[int, list[int]] = {1: [], 3: []}
        for _ in range(5):
            rows = logits[batch_order]
            tokens = sample(rows, temperature[batch_order], generators=[gens.get(r) for r in batch_order])
            for pos, r in enumerate(batch_order):
                if r in seq:
                    seq[r].append(int(tokens[pos]))
        return seq

    a = run([0, 1, 2, 3])
    b = run([3, 2, 1])
    assert a == b
    assert a[1] != a[3]
