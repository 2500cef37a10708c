"""The hot-expert cache's policy (engine/hot_experts.py): scores from wrapping pick counts, and the swaps toward each
layer's best-scoring experts."""

import numpy as np

from engine.hot_experts import DECAY, ExpertScores, Swap, plan_swaps


def test_free_slots_fill_with_the_best_scoring_experts_first():
    score = np.array([[0.0, 5.0, 1.0, 9.0, 3.0]])
    slot_of = np.full((1, 5), -1)
    swaps = plan_swaps(score, slot_of, capacity=2)
    assert swaps == [Swap(0, 0, -1, 3), Swap(0, 1, -1, 1)]


def test_an_expert_never_picked_takes_no_slot():
    assert plan_swaps(np.zeros((2, 4)), np.full((2, 4), -1), capacity=3) == []


def test_a_resident_leaves_only_for_a_clearly_better_expert():
    slot_of = np.array([[0, -1, -1, 1]])  # experts 0 and 3 hold slots 0 and 1
    close = np.array([[10.0, 11.0, 0.0, 20.0]])  # expert 1 beats 0, but by less than HYSTERESIS
    assert plan_swaps(close, slot_of, capacity=2) == []
    clear = np.array([[10.0, 30.0, 0.0, 20.0]])
    assert plan_swaps(clear, slot_of, capacity=2) == [Swap(0, 0, 0, 1)]


def test_the_largest_gains_go_first_across_layers_up_to_the_limit():
    score = np.array([[1.0, 0.0], [0.0, 8.0], [4.0, 0.0]])
    swaps = plan_swaps(score, np.full((3, 2), -1), capacity=1, max_swaps=2)
    assert swaps == [Swap(1, 0, -1, 1), Swap(2, 0, -1, 0)]


def test_every_slot_in_a_plan_is_free_or_vacated_once():
    rng = np.random.default_rng(0)
    for _ in range(50):
        experts, capacity = 16, 5
        slot_of = np.full((3, experts), -1)
        for layer in range(3):
            held = rng.choice(experts, rng.integers(0, capacity + 1), replace=False)
            slot_of[layer, held] = rng.permutation(capacity)[: len(held)]
        swaps = plan_swaps(rng.exponential(size=(3, experts)), slot_of, capacity, max_swaps=100)
        for layer in range(3):
            mine = [s for s in swaps if s.layer == layer]
            assert len({s.slot for s in mine}) == len(mine)
            for s in mine:
                assert slot_of[layer, s.new] < 0 and 0 <= s.slot < capacity
                assert (s.old < 0 and s.slot not in slot_of[layer]) or slot_of[layer, s.old] == s.slot


def test_scores_fold_new_picks_and_decay_across_a_counter_wrap():
    scores = ExpertScores()
    scores.add_layer(3)
    scores.add_layer(3)
    first = np.array([[4, 0, 2, 1], [0, 6, 0, 0]], np.uint32)  # last column: picks the cache held
    scores.fold(first)
    assert scores.picks == 12 and scores.hits == 1 and scores.recent_hit_rate == round(1 / 12, 4)
    near = first.copy()
    near[0, 1] = 2**32 - 2  # expert 1 of layer 0 about to wrap
    scores.fold(near)
    wrapped = near.copy()
    wrapped[0, 1] = 3  # five picks later
    wrapped[0, 3] += 5
    scores.fold(wrapped)
    want = np.array([[4 * DECAY**2, (2**32 - 2) * DECAY + 5, 2 * DECAY**2], [0, 6 * DECAY**2, 0]])
    assert np.allclose(scores.score, want)
    assert scores.recent == (5, 5) and scores.recent_hit_rate == 1.0
