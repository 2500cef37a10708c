"""Sampling: the reference op on hand-made distributions, the seeded host stream, and the order in which
decode steps and picks are queued."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.backend import SamplingParams
from engine.backend_numpy import NumpyBackend
from engine.errors import EngineError
from engine.generate import GenerationSettings, sampled_tokens
from engine.kernels.reference import sample
from engine.sampler import Sampler

# Probabilities 0.5, 0.25, 0.15, 0.07, 0.03 for ids 3, 0, 4, 1, 2 (deliberately not in id order).
PROBS = np.array([0.25, 0.07, 0.03, 0.5, 0.15])
LOGITS = np.log(PROBS).astype(np.float32)
def sampling(**given) -> SamplingParams:
    """GenerationSettings' sampling defaults with `given` changed."""
    return GenerationSettings(**given).sampling()


PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def picks(params: SamplingParams, logits=LOGITS, recent=np.zeros(0, np.int32), n=2000):
    """Which ids sample() returns over a uniform grid of n draws, with their frequencies."""
    chosen = [sample(logits, params, recent, u) for u in (np.arange(n) + 0.5) / n]
    ids, counts = np.unique(chosen, return_counts=True)
    return dict(zip(ids.tolist(), (counts / n).round(3).tolist()))


def test_plain_sampling_follows_the_distribution():
    assert picks(sampling(**PLAIN)) == {3: 0.5, 0: 0.25, 4: 0.15, 1: 0.07, 2: 0.03}


def test_greedy_and_top_k_1_pick_the_argmax():
    for u in (0.0, 0.3, 0.999):
        assert sample(LOGITS, sampling(temperature=0), np.zeros(0, np.int32), u) == 3
        assert sample(LOGITS, sampling(**{**PLAIN, "top_k": 1}), np.zeros(0, np.int32), u) == 3


def test_top_k_keeps_the_k_most_likely():
    assert set(picks(sampling(**{**PLAIN, "top_k": 2}))) == {3, 0}
    assert picks(sampling(**{**PLAIN, "top_k": 2}))[3] == pytest.approx(0.5 / 0.75, abs=1e-3)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token (0.15) is needed; 0.9 is reached without the last two.
    assert set(picks(sampling(**{**PLAIN, "top_p": 0.8}))) == {3, 0, 4}
    assert set(picks(sampling(**{**PLAIN, "top_p": 0.7}))) == {3, 0}
    assert set(picks(sampling(**{**PLAIN, "top_p": 0.1}))) == {3}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # 0.2 * 0.5 = 0.1: ids 1 (0.07) and 2 (0.03) go, 4 (0.15) stays.
    assert set(picks(sampling(**{**PLAIN, "min_p": 0.2}))) == {3, 0, 4}
    assert set(picks(sampling(**{**PLAIN, "min_p": 0.6}))) == {3}


def test_temperature_sharpens_and_flattens():
    cold = picks(sampling(**{**PLAIN, "temperature": 0.5}))
    hot = picks(sampling(**{**PLAIN, "temperature": 2.0}))
    assert cold[3] > 0.5 > hot[3]
    assert cold[3] == pytest.approx(0.25 / (PROBS**2).sum(), abs=2e-3)


def test_repeat_penalty_lowers_recent_tokens_of_either_sign():
    logits = np.array([2.0, -1.0, 1.9, -0.5], dtype=np.float32)
    greedy = sampling(temperature=0, repeat_penalty=1.5)
    assert sample(logits, greedy, np.array([0], np.int32), 0.5) == 2  # 2.0 / 1.5 < 1.9
    assert sample(logits, sampling(temperature=0), np.array([0], np.int32), 0.5) == 0
    # A negative logit is multiplied, so it moves further down, not up.
    negative = np.array([-1.0, -1.2], dtype=np.float32)
    assert sample(negative, greedy, np.array([0], np.int32), 0.5) == 1
    assert logits[0] == 2.0  # the op does not modify its input


def test_seed_reproduces_and_differs():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32) * 3
    params = sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)

    def run(seed):
        sampler = Sampler(NumpyBackend(), params, seed)
        return [sampler.next_token(logits) for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize(
    "params, fragment",
    [
        (sampling(temperature=-1), "temperature"),
        (sampling(top_k=-2), "top_k"),
        (sampling(top_p=0.0), "top_p"),
        (sampling(min_p=1.5), "min_p"),
        (sampling(repeat_penalty=0), "repeat_penalty"),
    ],
)
def test_bad_settings_are_explained(params, fragment):
    with pytest.raises(EngineError, match=fragment):
        Sampler(NumpyBackend(), params)


class _RecordingBackend(NumpyBackend):
    """A NumPy backend that logs when a pick is queued and when it is read back; `asynchronous` makes it stand
    in for a GPU backend."""

    def __init__(self, log: list[str], asynchronous: bool):
        super().__init__()
        self.log = log
        self.asynchronous = asynchronous

    def sample_feed(self, logits, params, uniform, ids, position):
        result = super().sample_feed(logits, params, uniform, ids, position)
        n = sum(e.startswith("pick") for e in self.log)
        self.log.append(f"pick{n}")

        def read():
            self.log.append(f"read{n}")
            return result()

        return read


def _toy_state(backend, capacity: int, log: list[str]):
    """A ModelState whose 'model' makes token t + 1 follow token t (vocab 50), logging each decode step."""
    from engine.generate import ModelState
    from engine.kv_cache import CachedTokens

    ws = SimpleNamespace(ids=np.zeros(2, np.int32), logits=np.zeros((1, 50), np.float32))

    def step(position: int):
        assert position == ws.ids[0]  # the caller names the position the fed ids hold
        log.append(f"step@{position}")
        ws.logits[0] = 0.0
        ws.logits[0, (ws.ids[1] + 1) % 50] = 1.0

    cached = CachedTokens(capacity)
    return ModelState(None, None, None, ws, None, backend, cached, step), ws


def test_sampled_tokens_queue_each_step_before_reading_the_token_it_feeds():
    log: list[str] = []
    backend = _RecordingBackend(log, asynchronous=True)
    state, ws = _toy_state(backend, capacity=100, log=log)
    state.cached.append([7, 8, 9])
    first = np.zeros(50, np.float32)
    first[10] = 1.0
    tokens = list(sampled_tokens(state, Sampler(backend, sampling(temperature=0)), first, limit=4))
    assert tokens == [10, 11, 12, 13]
    # The step at position 3 (feeding token 10) is queued before token 10 is read: the host's work overlaps it.
    assert log == ["pick0", "step@3", "pick1", "read0", "step@4", "pick2", "read1", "step@5", "pick3", "read2", "read3"]
    assert state.cached.tokens == [7, 8, 9, 10, 11, 12]  # every fed token; the last one was never fed


def test_sampled_tokens_on_a_synchronous_backend_compute_nothing_ahead():
    log: list[str] = []
    backend = _RecordingBackend(log, asynchronous=False)
    state, _ = _toy_state(backend, capacity=100, log=log)
    state.cached.append([7, 8, 9])
    first = np.zeros(50, np.float32)
    first[10] = 1.0
    tokens = sampled_tokens(state, Sampler(backend, sampling(temperature=0)), first, limit=4)
    assert [next(tokens), next(tokens)] == [10, 11]
    tokens.close()  # the caller stops after token 11: no step was run for it
    assert log == ["pick0", "read0", "step@3", "pick1", "read1"]
    assert state.cached.tokens == [7, 8, 9, 10]


def test_sampled_tokens_stop_at_the_end_of_the_context_and_penalty_picks_in_order():
    log: list[str] = []
    backend = _RecordingBackend(log, asynchronous=True)
    state, _ = _toy_state(backend, capacity=5, log=log)
    state.cached.append([1, 2])
    first = np.zeros(50, np.float32)
    first[3] = 1.0
    # With a repeat penalty the pick needs the host's history, so it is made at once (no queued reads).
    sampler = Sampler(backend, sampling(temperature=0, repeat_penalty=1.3), history=[1, 2])
    tokens = list(sampled_tokens(state, sampler, first, limit=10))
    assert tokens == [3, 4, 5, 6]  # positions 2, 3, 4 are fed; the fourth token has no room
    assert log == ["step@2", "step@3", "step@4"] and len(state.cached) == state.cached.capacity
