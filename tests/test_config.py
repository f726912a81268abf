"""Run config: presets, TOML loading, canonical bytes, clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eggroll_dist.shared.config import (
    LATER_SETTINGS,
    MAX_CANONICAL_BYTES,
    PRESETS,
    ConfigError,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    config_difference,
    from_canonical_bytes,
    load_config,
    preset,
)


def test_presets() -> None:
    paper = preset("egg-paper")
    assert (paper.model.n_layer, paper.model.d_model, paper.model.vocab_size) == (6, 256, 256)
    assert paper.es.seq_len == 100
    assert set(PRESETS) >= {"tiny", "egg-paper"}
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


def test_canonical_bytes_round_trip_and_digest() -> None:
    for cfg in PRESETS.values():
        raw = cfg.canonical_bytes()
        assert from_canonical_bytes(raw) == cfg
        assert from_canonical_bytes(raw).digest() == cfg.digest()
        assert b" " not in raw  # compact, sorted: one byte string per config
    tiny = preset("tiny")
    other = tiny.replace(es=ESConfig(**{**tiny.es.__dict__, "run_seed": 1}))
    assert other.digest() != tiny.digest()


def test_later_settings_at_their_default_keep_older_digests() -> None:
    """A config written before a later setting existed has no key for it; read back, it
    must keep its canonical bytes and digest, or its checkpoints would no longer load."""
    for cfg in PRESETS.values():
        data = json.loads(cfg.canonical_bytes())
        for section, key in LATER_SETTINGS:
            default = getattr(type(getattr(cfg, section))(), key)
            assert (key in data[section]) == (getattr(getattr(cfg, section), key) != default)
    # Pinned: the digests these presets had before any later setting existed.
    assert preset("tiny").digest().hex()[:16] == "5f3a4f277f4f3142"
    assert preset("d-eggs").digest().hex()[:16] == "5d230aa4ed359a96"
    old = preset("d-eggs")
    written_before = {"format": 1, **dataclasses.asdict(old)}  # what older versions wrote
    for section, key in LATER_SETTINGS:
        del written_before[section][key]
    raw = json.dumps(written_before, sort_keys=True, separators=(",", ":")).encode()
    assert raw == old.canonical_bytes()
    assert from_canonical_bytes(raw).digest() == old.digest()
    biased = old.replace(model=ModelConfig(**{**old.model.__dict__, "head_bias": "zero"}))
    assert b'"head_bias":"zero"' in biased.canonical_bytes()
    assert from_canonical_bytes(biased.canonical_bytes()) == biased
    assert biased.digest() != old.digest()


def test_toml_overrides_a_preset(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'preset = "egg-paper"\nsteps = 7\n[es]\npopulation = 64\nchunk_size = 16\n'
        "[update]\nalpha = 0.25\n"
    )
    cfg = load_config(path)
    assert cfg.steps == 7 and cfg.es.population == 64 and cfg.model.n_layer == 6
    assert cfg.update.alpha == 0.25 and cfg.chunks == 4 and cfg.pairs == 32


@pytest.mark.parametrize(
    "body,message",
    [
        ("[es]\npopulation = 63\nchunk_size = 7", "es.population=63 must be even"),
        ("[es]\npopulation = 64\nchunk_size = 7", "chunk_size=7 must be a whole number of pairs"),
        ("[es]\npopulation = 64\nchunk_size = 24", "not divisible by es.chunk_size=24"),
        ("[es]\npopsize = 4", "unknown key 'es.popsize'"),
        ("[es]\nseq_len = 'long'", "'es.seq_len' must be int"),
        ("[update]\nalpha = 2.5", "must be an integer"),
        ("[model]\narch = 'rnn'", "must be 'egg', 'former' or 'hf'"),
        ("[model]\narch = 'former'\nhead_bias = 'unigram'", "must be 'none', 'zero' or 'zipf'"),
        ("[model]\nhead_bias = 'zipf'", "model.head_bias='zipf' needs model.arch='former'"),
        ("colour = 3", "unknown config key 'colour'"),
        ("[es\n", "not valid TOML"),
    ],
)
def test_invalid_configs_give_one_clear_line(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_invalid_values_rejected_in_code_too() -> None:
    with pytest.raises(ConfigError, match=r"es\.population=10 is not divisible"):
        RunConfig(es=ESConfig(population=10, chunk_size=4))


def test_canonical_bytes_from_a_peer_are_bounded() -> None:
    with pytest.raises(ConfigError, match="nest too deeply"):
        from_canonical_bytes(b"[" * 60000)
    with pytest.raises(ConfigError, match="the limit is"):
        from_canonical_bytes(b" " * (MAX_CANONICAL_BYTES + 1))


def test_config_difference_names_the_settings_and_what_a_changed_pin_means() -> None:
    from eggroll_dist.shared.config import config_difference

    base = preset("tiny")
    wider = base.replace(model=dataclasses.replace(base.model, d_model=32))
    assert config_difference(base, wider) == "model.d_model 64 -> 32"
    reward = base.replace(
        fitness=dataclasses.replace(
            base.fitness,
            objective="reward",
            reward="r.py:f",
            prompts="data",
            reward_sha256="a" * 64,
        )
    )
    fixed = reward.replace(fitness=dataclasses.replace(reward.fitness, reward_sha256="b" * 64))
    assert config_difference(reward, fixed) == (
        "fitness.reward_sha256 (the reward file's bytes changed)"
    )
    many = wider.replace(steps=7, es=dataclasses.replace(wider.es, run_seed=5, seq_len=8))
    assert config_difference(base, many).endswith("; and 1 more")


def test_a_weighted_reward_combination_round_trips(tmp_path: Path) -> None:
    """fitness.rewards, a TOML array of "REWARD:WEIGHT", reaches a worker as the same config;
    a changed file part's digest is named as a changed file."""
    path = tmp_path / "run.toml"
    path.write_text(
        '[fitness]\nobjective = "reward"\nprompts = "data"\n'
        'rewards = ["builtin:letter_e:0.3", "score.py:score:0.7", "lambda text: 1.0:-1"]\n'
        f"rewards_sha256 = [{json.dumps('a' * 64)}]\n"
    )
    cfg = load_config(path)
    assert cfg.fitness.rewards[2] == "lambda text: 1.0:-1" and cfg.fitness.reward == ""
    assert from_canonical_bytes(cfg.canonical_bytes()) == cfg
    moved = cfg.replace(fitness=dataclasses.replace(cfg.fitness, rewards_sha256=("b" * 64,)))
    assert config_difference(cfg, moved) == (
        "fitness.rewards_sha256 (a reward file's bytes changed)"
    )
    reward = 'objective = "reward"\n'
    for body, message in (
        (f'{reward}rewards = ["builtin:letter_e:1", 2]', "'fitness.rewards' must be a list of str"),
        ('rewards = ["a.py:1", "b.py:1"]', "fitness.rewards is set but fitness.objective"),
        (f'{reward}rewards = ["a.py:1", "b.py:1"]\nrewards_sha256 = ["ab"]', "64 hex digits"),
        (f'{reward}rewards = ["a.py:1", "builtin:brackets:1"]\nrewards_sha256 = []', ""),
    ):
        path.write_text(f'[fitness]\nprompts = "data"\n{body}\n')
        if not message:
            assert load_config(path).fitness.rewards_sha256 == ()  # pinned when loaded
            continue
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_reward_chunk_too_large_to_hold_is_refused() -> None:
    """A config a coordinator sends must not make a worker allocate what no machine has
    (8,786 members x 1,024 prompts x 4,096 tokens was 275 GiB in one array)."""
    fitness = FitnessConfig(
        objective="reward",
        reward="builtin:letter_e",
        prompts="data",
        prompts_per_step=1024,
        completion_tokens=4096,
    )
    with pytest.raises(ConfigError, match="tokens a chunk; the limit is 67,108,864"):
        RunConfig(es=ESConfig(population=17572, chunk_size=8786), fitness=fitness)
    small = dataclasses.replace(fitness, prompts_per_step=8, completion_tokens=64)
    RunConfig(es=ESConfig(population=17572, chunk_size=8786), fitness=small)
