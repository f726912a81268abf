"""A reward run's generation on the CuPy backend equals the NumPy backend's, token for token.

Runs on the CPU build of the kernels by default (every thread order), on a GPU with
EGGROLL_KERNEL_TARGET=cupy: members' and the unperturbed model's completions after a device
update, prompts of several lengths (token 0 inside one: the EGG state resets), every
sampling setting, widths that are no multiple of 32 and a vocabulary above 256; for the
former, histories that fit the context (each position against the key-value cache) and
histories that outrun it, inside the prompt or after (the window slides); and the device
computes them: no model, noise or sampling maths on the host.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_target import CPU_BUILD_MISSING, VARIANTS
from test_cupy_backend import CONFIGS, cupy_backend, dataset

from eggroll_dist.shared import egg, former, perturb, sample
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

pytestmark = pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))

GEN_CONFIGS = {
    # width 36 (a partial K stage), 2 layers, gaussian noise, a vocabulary of 300
    "egg-wide": RunConfig(
        model=ModelConfig(n_layer=2, d_model=36, vocab_size=300, init_seed=4),
        es=ESConfig(population=12, chunk_size=6, seq_len=3, noise="gaussian", run_seed=7),
        update=UpdateConfig(alpha=1.0),
    ),
    # token noise and adaptive noise (the noise kernels' factors), width 20
    "egg-adaptive": CONFIGS["egg-adaptive"].replace(
        model=ModelConfig(n_layer=1, d_model=20, vocab_size=64, init_seed=9)
    ),
    # the former at width 36 (heads of 12), 2 layers, the head bias, token and adaptive
    # noise; a context of 6: only the shortest prompt's history fits it to the end, the
    # longest outruns it inside the prompt
    "former-wide": CONFIGS["former"].replace(
        model=ModelConfig(
            arch="former", n_layer=2, d_model=36, n_head=3, vocab_size=300, head_bias="zipf"
        ),
        es=dataclasses.replace(CONFIGS["former"].es, seq_len=6),
    ),
    # width 20 (heads of 10: rows of no whole words), no head bias, a context of 8: only
    # the longest prompt's history outruns it
    "former-narrow": CONFIGS["former-d-eggs"].replace(
        model=ModelConfig(arch="former", n_layer=1, d_model=20, n_head=2, vocab_size=300),
        es=dataclasses.replace(CONFIGS["former-d-eggs"].es, seq_len=8),
    ),
}
SETTINGS = (
    sample.SampleSettings(),  # the defaults: temperature 0.6, min-p, a presence penalty
    sample.SampleSettings(temperature=0, presence_penalty=300, frequency_penalty=100),
    sample.SampleSettings(temperature=1500, min_p=0, top_k=3, frequency_penalty=700),
    sample.SampleSettings(temperature=1000, min_p=0, presence_penalty=0),  # a reward run's
)
# The former's step is some 40 launches (the CPU build's cost): each former config takes
# two settings, one sampled at temperature and one greedy or top-k.
CONFIG_SETTINGS = {"former-wide": (0, 1), "former-narrow": (2, 3)}
PROMPTS = ((1, 2, 3), (5,), (7, 0, 9), (4, 4, 8, 2, 6, 1), (11,))


def _stepped(cfg: RunConfig, variant: str) -> tuple[NumpyBackend, object]:
    """Both backends one update past step 0, so the device's weights are its own."""
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg), batch_members=6)
    gpu = cupy_backend(cfg, data, variant, True)
    fitness = np.tile(np.array([1, -1, 0], dtype=np.int8), cfg.pairs)[: cfg.pairs]
    assert gpu.apply_step(fitness) == ref.apply_step(fitness)
    return ref, gpu


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(GEN_CONFIGS))
def test_device_generation_gives_the_numpy_backends_tokens(name: str, variant: str) -> None:
    cfg = GEN_CONFIGS[name]
    ref, gpu = _stepped(cfg, variant)
    v = cfg.model.vocab_size
    prompts = (*PROMPTS, (v - 1, v - 2))
    for i in CONFIG_SETTINGS.get(name, range(len(SETTINGS))):
        settings = SETTINGS[i]
        request = sample.Completions(prompts, tuple(range(i, i + 6)), 9 + i, settings, 5)
        got = gpu.complete(1, (2, 8), request)  # members 2..9: batches of 6 members
        assert got.shape == (8, len(prompts), 5)
        assert np.array_equal(got, ref.complete(1, (2, 8), request)), settings
        alone = gpu.complete(1, None, request)  # 6 prompts: 3 pairs of zero noise
        assert np.array_equal(alone, ref.complete(1, None, request)), settings
    assert not np.array_equal(got[0], got[1])  # a pair's members write differently


def test_an_odd_number_of_prompts_pads_the_unperturbed_rows() -> None:
    ref, gpu = _stepped(GEN_CONFIGS["egg-adaptive"], VARIANTS[0])
    request = sample.Completions(PROMPTS[:3], (4, 5, 6), 2, sample.SampleSettings(), 5)
    assert np.array_equal(gpu.complete(1, None, request), ref.complete(1, None, request))
    with pytest.raises(ValueError, match="step"):
        gpu.complete(0, (0, 2), request)  # the replica is at step 1


def test_the_former_reads_prompts_that_outrun_its_context() -> None:
    """The generated tokens of test_device_generation... slide the former's window, inside
    a prompt or after it, and some fit it to the end."""
    for name in ("former-wide", "former-narrow"):
        t = GEN_CONFIGS[name].es.seq_len
        reads = [1 + len(p) + 5 - 1 for p in (*PROMPTS, (1, 2))]  # as NumpyBackend's
        assert min(reads) <= t < max(reads), name
    assert 1 + max(len(p) for p in PROMPTS) > GEN_CONFIGS["former-wide"].es.seq_len


@pytest.mark.parametrize("name", ["egg-wide", "former-wide"])
def test_no_generation_maths_on_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the host's models, noise and sampling made to raise, the device still writes
    the reference's tokens."""
    cfg = GEN_CONFIGS[name]
    ref, gpu = _stepped(cfg, VARIANTS[0])
    request = sample.Completions(PROMPTS, (0, 1, 2, 3, 4), 5, SETTINGS[2], 6)
    want = (ref.complete(1, (0, 6), request), ref.complete(1, None, request))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the host computed what the device must")

    for module, names in (
        (perturb, ("pair_noise", "member_noise", "noise_scales", "perturbed_mm")),
        (sample, ("next_token", "next_tokens", "token_weights", "generate_rows", "penalized")),
    ):
        for fn in names:
            monkeypatch.setattr(module, fn, refuse)
    for model in (egg.EggModel, former.FormerModel):
        for method in ("__init__", "forward", "step", "logits", "hidden", "head", "decoder"):
            if hasattr(model, method):
                monkeypatch.setattr(model, method, refuse)
    monkeypatch.setattr(former.FormerDecoder, "read", refuse)
    monkeypatch.setattr(NumpyBackend, "__init__", refuse)
    assert np.array_equal(gpu.complete(1, (0, 6), request), want[0])
    assert np.array_equal(gpu.complete(1, None, request), want[1])
