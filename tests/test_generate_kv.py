"""The former's generation with a key-value cache equals reading the whole window per token.

The reference is the former's first decoder, kept here: each read appends the token to the
row's history (at most seq_len tokens) and computes the whole window again. The cached
decoder must give the same logits at every read, before and after the window slides, for
members and for the unperturbed model, and so the same generated tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.former import FormerDecoder, FormerGenerator, FormerModel
from eggroll_dist.shared.model import param_specs
from eggroll_dist.shared.perturb import MemberNoise, member_noise, pair_noise
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.sample import Completions, SampleSettings, generate
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend


class WholeWindowDecoder:
    """The reference: every read computes the row's whole window (at most seq_len)."""

    def __init__(self, model: FormerModel, noise: MemberNoise | None, rows: int):
        self.model, self.noise = model, noise
        self.history = np.zeros((rows, 0), dtype=np.int64)

    def read(self, tokens: np.ndarray) -> np.ndarray:
        self.history = np.concatenate([self.history, tokens[:, None]], axis=1)
        self.history = self.history[:, -self.model.context :]
        h = self.model.hidden(self.history, self.noise)
        return self.model.head(h[:, -1:], self.noise)[:, 0]


CONFIGS = {
    # heads of 12 (width 36: no multiple of 32), a vocabulary above 256, a head bias
    "wide-heads": RunConfig(
        model=ModelConfig(
            arch="former", n_layer=2, d_model=36, n_head=3, vocab_size=300, head_bias="zipf"
        ),
        es=ESConfig(population=8, chunk_size=4, seq_len=7, run_seed=3),
    ),
    # heads of 2 (width 10), gaussian noise, a short context
    "narrow": RunConfig(
        model=ModelConfig(arch="former", n_layer=1, d_model=10, n_head=5, vocab_size=45),
        es=ESConfig(population=8, chunk_size=4, seq_len=4, noise="gaussian", run_seed=5),
    ),
}


def _noise(cfg: RunConfig, state: ReplicaState, pairs: list[int]) -> MemberNoise:
    specs = param_specs(cfg.model)
    raw = pair_noise(cfg, specs, 0, np.array(pairs))
    return member_noise(raw, state.params, cfg.es.sigma_shift)


def _whole_window(model: FormerModel, noise: MemberNoise | None, rows: int) -> object:
    return WholeWindowDecoder(model, noise, rows)


@pytest.mark.parametrize("members", [False, True], ids=["unperturbed", "members"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_read_gives_the_whole_windows_logits(name: str, members: bool) -> None:
    cfg = CONFIGS[name]
    state = ReplicaState.initial(cfg)
    model = FormerModel(cfg, state.params)
    noise = _noise(cfg, state, [0, 3]) if members else None
    rows = 4 if members else 3
    rng = np.random.default_rng(7)
    stream = rng.integers(0, cfg.model.vocab_size, size=(rows, 3 * cfg.es.seq_len))
    stream[:, 0] = 0
    stream[1, 4] = 0  # a separator inside: the former reads it as any token
    cached, whole = model.decoder(noise, rows), WholeWindowDecoder(model, noise, rows)
    assert isinstance(cached, FormerDecoder)
    for t in range(stream.shape[1]):  # past seq_len: the window slides
        got, want = cached.read(stream[:, t]), whole.read(stream[:, t])
        assert np.array_equal(got, want), t
        assert np.array_equal(cached.history, whole.history)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_completions_equal_the_whole_window_decoder(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members' and the unperturbed model's completions, prompts of several lengths (one
    longer than the context) and completions that outrun it."""
    cfg = CONFIGS[name]
    state = ReplicaState.initial(cfg)
    v, n = cfg.model.vocab_size, cfg.es.seq_len + 3
    prompts = ((1,), (v - 1, 2), (5, 6, 7, 8, 9, 10, 11, 12)[: cfg.es.seq_len + 1], (3, 0, 4))
    backend = NumpyBackend(_data(v), state, batch_members=4)
    for settings in (SampleSettings(), SampleSettings(temperature=0, presence_penalty=0)):
        request = Completions(prompts, (0, 1, 2, 3), 11, settings, n)
        got = (backend.complete(0, (2, 6), request), backend.complete(0, None, request))
        with monkeypatch.context() as patch:
            patch.setattr(FormerModel, "decoder", _whole_window)
            want = (backend.complete(0, (2, 6), request), backend.complete(0, None, request))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_the_generator_follows_its_state_and_reads_another_afresh() -> None:
    cfg = CONFIGS["wide-heads"]
    params = ReplicaState.initial(cfg).params
    gen, model = FormerGenerator(cfg, params), FormerModel(cfg, params)
    settings = SampleSettings()
    one = list(generate(gen, [4, 5, 6], 2 * cfg.es.seq_len, settings, seed=3))
    two = list(generate(gen, [4, 5, 6], 2 * cfg.es.seq_len, settings, seed=3))
    assert one == two
    state, _ = gen.start()
    state, _ = gen.step(state, 9)
    other, logits = gen.step([0, 4, 5], 6)  # not the history it last read
    assert other == [0, 4, 5, 6]
    assert np.array_equal(logits, model.logits(np.array([other]))[0, -1])


def _data(vocab: int) -> object:
    from types import SimpleNamespace

    rng = np.random.default_rng(2)
    train = rng.integers(0, vocab, size=500).astype(np.uint16)
    pieces = [bytes([i % 256]) for i in range(vocab)]
    meta = SimpleNamespace(ids_by_frequency=True)
    return SimpleNamespace(train=train, valid=train[:100], decoding=pieces, meta=meta)
