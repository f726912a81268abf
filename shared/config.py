"""The run config: everything a replica's state depends on, with canonical bytes and a digest.

Two replicas agree bit for bit when their configs have the same digest and they applied
the same fitness log (`replay` in shared/replica.py). Configs come from a named preset or
a TOML file whose tables mirror the dataclasses below:

    preset = "tiny"            # optional: start from a preset, then override
    steps = 300
    [model]  arch, vocab_size, n_layer, d_model, n_head, init_seed, head_bias, init_from,
             path, targets, rank, weight_dtype (arch "hf": shared/hf.py)
    [es]     population, chunk_size, seq_len, sigma_shift, noise, run_seed, adaptive_noise,
             token_noise_rows, sigma (arch "hf")
    [fitness] chunk_mean_filter, adaptive_threshold,
             objective, reward, prompts, prompts_per_step, completion_tokens, temperature,
             min_p, held_out_prompts, rewards (the reward objective: shared/objectives/reward.py)
    [update] rule, alpha, alpha_decay_steps, momentum_shift,
             lr, lr_halve_steps, lr_halvings, beta1, beta2, weight_decay
    [data]   data_seed
    [validation] every_steps, max_tokens
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import ARCHS
from .objectives import OBJECTIVES
from .rules import RULES

CONFIG_FORMAT = 1
MAX_SEED = (1 << 64) - 1


class ConfigError(ValueError):
    """An invalid run config; the message is one line that says what to change."""


@dataclass(frozen=True)
class ModelConfig:
    # a name in shared/model.py ARCHS: "egg" (nano-egg's minGRU), "former" (d-eggs'
    # transformer), "hf" (a Hugging Face causal LM)
    arch: str = "egg"
    vocab_size: int = 256
    n_layer: int = 1
    d_model: int = 64
    n_head: int = 0  # former: attention heads; 0 = d_model // 64 (d-eggs' head size), at least 1
    init_seed: int = 0
    # former: "none" (d-eggs: the tied head has no bias), or a bias per token added to the
    # logits, starting at "zero" or at "zipf": 1/rank when ids are ranked by frequency, as
    # eggroll-data prepare --tokenizer bpe ranks them (see shared/former.py)
    head_bias: str = "none"
    # Start from a trained replica instead of init_seed's weights: a checkpoint or snapshot
    # file (relative to the config file, or a worker's --goal-dir), recorded with its replica
    # digest; only its weights are taken (shared/start.py)
    init_from: str = ""
    init_digest: str = ""  # 16 hex digits, filled in when the config is loaded
    # arch "hf" (shared/hf.py): a Hugging Face causal LM directory (relative to the config
    # file, or a worker's --goal-dir), the module-name globs of the matrices that learn
    # (none: every linear layer of the blocks) and the rank of their noise. Filled in when
    # the config is loaded: the directory's files ("sha256 name") and the chosen matrices
    # ("name out in"), and the dtype the targets have in the directory's safetensors files
    # ("bfloat16", "float16" or "float32"), which the replica state holds them in.
    path: str = ""
    targets: tuple[str, ...] = ()
    rank: int = 1
    files: tuple[str, ...] = ()
    matrices: tuple[str, ...] = ()
    weight_dtype: str = ""

    @property
    def heads(self) -> int:
        return self.n_head or max(1, self.d_model // 64)


@dataclass(frozen=True)
class ESConfig:
    population: int = 512  # members per step; pairs (m, m+1) share noise with opposite sign
    chunk_size: int = 128  # members per chunk, the unit of work leased to a worker
    seq_len: int = 32  # tokens scored per member per step (each pair reads seq_len + 1)
    sigma_shift: int = 4  # perturbation = (x.b) * a >> (4 + sigma_shift)
    noise: str = "uniform"  # "uniform" (d-eggs) or "gaussian"
    run_seed: int = 0
    # d-eggs' overlays: per matrix row / column and vector element, noise fades where the
    # weights stopped moving (replica state; see shared/perturb.py)
    adaptive_noise: bool = False
    # Only the token rows (embedding, egg head, former head bias) with ids below this get
    # noise; the others get no votes (only adamw's decay moves them). These are the
    # commonest tokens when ids are ranked by frequency, as `eggroll-data prepare
    # --tokenizer bpe` ranks them; 0 = every row (see shared/perturb.py)
    token_noise_rows: int = 0
    # model.arch "hf": the standard deviation of a member's perturbation of each target
    # weight (a float the evaluation reads; shared/hf.py)
    sigma: float = 0.0


@dataclass(frozen=True)
class FitnessConfig:
    chunk_mean_filter: bool = False  # d-eggs: add sign(m)|m|^1.2 of the chunk mean diff
    adaptive_threshold: bool = False  # d-eggs: zero where |diff| < 0.1 * chunk mean |diff|
    # "next_token": the loss of the data's windows; "reward": every member continues the
    # step's prompts and a reward function scores the text (shared/objectives/reward.py)
    objective: str = "next_token"
    # "file.py:function" or "file.py" (relative to the config file), "builtin:NAME", or
    # "lambda text: ..." (shared/objectives/reward.py)
    reward: str = ""
    reward_sha256: str = ""  # of the reward file's bytes, filled in when the config is loaded
    prompts: str = ""  # a prompts file (one per line, or JSON lines), or "data"
    prompts_sha256: str = ""
    prompts_per_step: int = 8  # prompts every member continues per step
    completion_tokens: int = 32  # tokens generated per prompt
    temperature: int = 1000  # thousandths (shared/sample.py): 1000 = 1.0, 0 = greedy
    min_p: int = 0  # thousandths
    held_out_prompts: int = 64  # scored by the unperturbed model at every validation
    # Instead of `reward`, a weighted combination: "REWARD:WEIGHT" parts; a completion
    # scores the fsum of weight * reward in this order
    rewards: tuple[str, ...] = ()
    rewards_sha256: tuple[str, ...] = ()  # of each file part's bytes, in order (filled in)


@dataclass(frozen=True)
class UpdateConfig:
    # a name in shared/rules RULES: "ztest" (stateless), "momentum" (an accumulator per
    # weight) or "adamw" (fixed-point AdamW; each rule's module specifies every operation)
    rule: str = "ztest"
    # alpha > 1 (an integer): level a_t = 1 / ((2**alpha - 1) * t / alpha_decay_steps + 1);
    # alpha <= 1: a constant level. About a_t of the weights move by one step each update.
    alpha: float = 4.0
    alpha_decay_steps: int = 1000
    momentum_shift: int = 3  # momentum: decay beta = 1 - 2**-momentum_shift per step
    # adamw (d-eggs' defaults): weight steps per unit normalised update, halved every
    # lr_halve_steps steps at most lr_halvings times (0.5, 0.25, then 0.125 from step 200)
    lr: float = 0.5
    lr_halve_steps: int = 100
    lr_halvings: int = 2
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.01  # decoupled, on matrices only (not norm gains or biases)


@dataclass(frozen=True)
class DataConfig:
    data_seed: int = 0


@dataclass(frozen=True)
class ValidationConfig:
    every_steps: int = 25  # 0 = only at the end
    max_tokens: int = 32768  # held-out tokens scored per validation; 0 = all of valid.bin


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    es: ESConfig = field(default_factory=ESConfig)
    fitness: FitnessConfig = field(default_factory=FitnessConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    steps: int = 300  # default run length; a command-line --steps overrides it

    def __post_init__(self) -> None:
        validate(self)

    @property
    def pairs(self) -> int:
        return self.es.population // 2

    @property
    def chunks(self) -> int:
        return self.es.population // self.es.chunk_size

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for section, key in LATER_SETTINGS:
            if data[section][key] == getattr(_SECTIONS[section](), key):
                del data[section][key]
        return {"format": CONFIG_FORMAT, **data}

    def canonical_bytes(self) -> bytes:
        """Sorted-key compact JSON: the bytes the digest, checkpoints and WELCOME carry."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical_bytes()).digest()

    def replace(self, **sections: Any) -> RunConfig:
        """A copy with some top-level fields or whole sections replaced."""
        return dataclasses.replace(self, **sections)


# Pinned digests, and what their change means to a user who edited a file.
_PINNED_WHAT = {
    "fitness.reward_sha256": "the reward file's bytes changed",
    "fitness.prompts_sha256": "the prompts file's bytes changed",
    "fitness.rewards_sha256": "a reward file's bytes changed",
    "model.init_digest": "model.init_from holds another replica",
    "model.files": "the model directory's files changed",
}


def config_difference(old: RunConfig, new: RunConfig, most: int = 3) -> str:
    """The settings two configs disagree on, for a line that refuses one of them: 'model.
    d_model 64 -> 128; fitness.reward_sha256 (the reward file's bytes changed)'."""
    a, b = old.to_dict(), new.to_dict()
    found = []
    for section in sorted(set(a) | set(b)):
        left, right = a.get(section), b.get(section)
        if not isinstance(left, dict) or not isinstance(right, dict):
            if left != right:
                found.append(f"{section} {left!r} -> {right!r}")
            continue
        for key in sorted(set(left) | set(right)):
            x, y = left.get(key), right.get(key)
            if x == y:
                continue
            name = f"{section}.{key}"
            found.append(
                f"{name} ({_PINNED_WHAT[name]})"
                if name in _PINNED_WHAT
                else f"{name} {x!r} -> {y!r}"
            )
    more = f"; and {len(found) - most} more" if len(found) > most else ""
    return "; ".join(found[:most]) + more


# Settings added after configs were first written: at their default they are left out of
# the canonical bytes, so that a config written before they existed keeps its digest (and
# its checkpoints stay loadable). Every later setting is appended here.
LATER_SETTINGS = (
    ("model", "head_bias"),
    ("model", "init_from"),
    ("model", "init_digest"),
    *(("model", key) for key in ("path", "targets", "rank", "files", "matrices")),
    ("es", "sigma"),
    *(
        ("fitness", key)
        for key in (
            "objective",
            "reward",
            "reward_sha256",
            "prompts",
            "prompts_sha256",
            "prompts_per_step",
            "completion_tokens",
            "temperature",
            "min_p",
            "held_out_prompts",
            "rewards",
            "rewards_sha256",
        )
    ),
    ("model", "weight_dtype"),
)

_SECTIONS = {
    "model": ModelConfig,
    "es": ESConfig,
    "fitness": FitnessConfig,
    "update": UpdateConfig,
    "data": DataConfig,
    "validation": ValidationConfig,
}


# A step's packed fitness (population / 10 bytes) stays within a 16 MiB protocol frame.
MAX_POPULATION = 1 << 27


def _names(registry: dict[str, Any]) -> str:
    """'a', 'b' or 'c': a registry's keys for an error line."""
    names = [repr(n) for n in registry]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError with one clear line for the first invalid value."""
    m, es, up = cfg.model, cfg.es, cfg.update
    _check(m.arch in ARCHS, f"model.arch={m.arch!r} must be {_names(ARCHS)}")
    _check(2 <= m.vocab_size <= 1 << 20, f"model.vocab_size={m.vocab_size} must be 2..2**20")
    _check(1 <= m.n_layer <= 64, f"model.n_layer={m.n_layer} must be 1..64")
    # 1024 keeps every int32 product of the forward pass far from overflow.
    _check(4 <= m.d_model <= 1024, f"model.d_model={m.d_model} must be 4..1024")
    _check(0 <= m.n_head <= m.d_model, f"model.n_head={m.n_head} must be 0..d_model")
    _check(
        m.head_bias in ("none", "zero", "zipf"),
        f"model.head_bias={m.head_bias!r} must be 'none', 'zero' or 'zipf'",
    )
    problem = ARCHS[m.arch].check(cfg)  # the architecture's own settings
    _check(problem is None, problem or "")
    _check(
        es.population >= 2 and es.population % 2 == 0,
        f"es.population={es.population} must be even and >= 2 (members come in ± pairs)",
    )
    _check(
        es.population <= MAX_POPULATION,
        f"es.population={es.population:,} is above {MAX_POPULATION:,}: a step's fitness "
        "(5 pairs a byte) must fit one message to the workers",
    )
    _check(
        es.chunk_size >= 2 and es.chunk_size % 2 == 0,
        f"es.chunk_size={es.chunk_size} must be a whole number of pairs (even, >= 2)",
    )
    _check(
        es.population % es.chunk_size == 0,
        f"es.population={es.population} is not divisible by es.chunk_size={es.chunk_size}",
    )
    _check(1 <= es.seq_len <= 1 << 16, f"es.seq_len={es.seq_len} must be 1..65536")
    _check(0 <= es.sigma_shift <= 15, f"es.sigma_shift={es.sigma_shift} must be 0..15")
    _check(
        es.noise in ("uniform", "gaussian"),
        f"es.noise={es.noise!r} must be 'uniform' or 'gaussian'",
    )
    _check(
        0 <= es.token_noise_rows <= m.vocab_size,
        f"es.token_noise_rows={es.token_noise_rows} must be 0..model.vocab_size",
    )
    _check_fitness(cfg)
    _check(
        not m.init_digest or (m.init_from and _is_hex(m.init_digest, 16)),
        f"model.init_digest={m.init_digest!r} must be the 16 hex digits of the replica digest "
        "of model.init_from",
    )
    _check(up.rule in RULES, f"update.rule={up.rule!r} must be {_names(RULES)}")
    # The bounds keep every fixed-point product of the adamw rule inside int64.
    _check(1 / (1 << 16) <= up.lr <= 16, f"update.lr={up.lr} must be in 2**-16..16 (weight steps)")
    _check(up.lr_halve_steps >= 1, f"update.lr_halve_steps={up.lr_halve_steps} must be >= 1")
    _check(0 <= up.lr_halvings <= 16, f"update.lr_halvings={up.lr_halvings} must be 0..16")
    for name, beta in (("beta1", up.beta1), ("beta2", up.beta2)):
        _check(0 <= beta <= 0.999, f"update.{name}={beta} must be in 0..0.999")
    _check(0 <= up.weight_decay <= 1, f"update.weight_decay={up.weight_decay} must be in 0..1")
    _check(
        1 <= up.momentum_shift <= 12,
        f"update.momentum_shift={up.momentum_shift} must be 1..12",
    )
    _check(up.alpha > 0, f"update.alpha={up.alpha} must be > 0")
    _check(
        up.alpha <= 1 or (float(up.alpha).is_integer() and up.alpha <= 30),
        f"update.alpha={up.alpha}: above 1 it is a decay exponent and must be an integer <= 30",
    )
    _check(
        up.alpha_decay_steps >= 1, f"update.alpha_decay_steps={up.alpha_decay_steps} must be >= 1"
    )
    _check(cfg.validation.every_steps >= 0, "validation.every_steps must be >= 0")
    _check(cfg.validation.max_tokens >= 0, "validation.max_tokens must be >= 0")
    _check(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1")
    for name, seed in (
        ("model.init_seed", m.init_seed),
        ("es.run_seed", es.run_seed),
        ("data.data_seed", cfg.data.data_seed),
    ):
        _check(0 <= seed <= MAX_SEED, f"{name}={seed} must be in 0..2**64-1")


def _is_hex(text: str, digits: int) -> bool:
    return len(text) == digits and all(c in "0123456789abcdef" for c in text)


def _check_fitness(cfg: RunConfig) -> None:
    f = cfg.fitness
    _check(
        f.objective in OBJECTIVES,
        f"fitness.objective={f.objective!r} must be {_names(OBJECTIVES)}",
    )
    for name in ("reward_sha256", "prompts_sha256"):
        value = getattr(f, name)
        _check(not value or _is_hex(value, 64), f"fitness.{name} must be 64 hex digits")
    _check(
        all(_is_hex(v, 64) for v in f.rewards_sha256),
        "fitness.rewards_sha256 must be digests of 64 hex digits",
    )
    problem = OBJECTIVES[f.objective].check(cfg)  # the objective's own settings
    _check(problem is None, problem or "")


def _typed(section: str, cls: type, values: dict[str, Any]) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key '{section}.{key}' (known: {', '.join(known)})")
        want = type(getattr(cls(), key))
        if want is tuple and isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(f"'{section}.{key}' must be a list of strings")
            values[key] = value = tuple(value)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[key] = float(value)
        elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(
                f"'{section}.{key}' must be {want.__name__}, got {type(value).__name__} {value!r}"
            )
    return cls(**values)


def from_dict(data: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """Build a config from nested dicts, overriding `base` (default: the dataclass defaults)."""
    data = dict(data)
    base = base or RunConfig()
    if data.pop("format", CONFIG_FORMAT) != CONFIG_FORMAT:
        raise ConfigError(f"config format is not {CONFIG_FORMAT}; this version cannot read it")
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a table of settings")
            merged = {**dataclasses.asdict(getattr(base, key)), **value}
            changes[key] = _typed(key, _SECTIONS[key], merged)
        elif key == "steps":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"'steps' must be an integer, got {value!r}")
            changes[key] = value
        else:
            raise ConfigError(
                f"unknown config key '{key}' (known: {', '.join([*_SECTIONS, 'steps'])})"
            )
    return dataclasses.replace(base, **changes)


# A canonical config is about 1 KiB; anything far larger did not come from a coordinator.
MAX_CANONICAL_BYTES = 64 * 1024


def from_canonical_bytes(raw: bytes) -> RunConfig:
    """Inverse of `RunConfig.canonical_bytes` (what a worker receives in WELCOME)."""
    if len(raw) > MAX_CANONICAL_BYTES:
        raise ConfigError(f"run config is {len(raw)} bytes; the limit is {MAX_CANONICAL_BYTES}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"run config bytes are not valid JSON: {exc}") from None
    except RecursionError:  # deeply nested arrays: never a config, maybe a hostile peer
        raise ConfigError("run config bytes nest too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError("run config bytes are not a JSON object")
    return from_dict(data)


PRESETS: dict[str, RunConfig] = {
    # Tuned to learn fastest per second on a 2-core CPU with the NumPy backend: a small,
    # one-layer model with a large population beat wider, deeper or longer-context variants;
    # gaussian noise one shift stronger than d-eggs' and the momentum rule beat the rest of
    # the sweep in scripts/RESULTS.md (`scripts/sweep.py`). More workers: raise es.population (one
    # chunk of 512 members per worker and step at least), not the steps.
    "tiny": RunConfig(
        es=ESConfig(population=2048, chunk_size=512, seq_len=32, sigma_shift=3, noise="gaussian"),
        update=UpdateConfig(rule="momentum", momentum_shift=2),
        validation=ValidationConfig(every_steps=50, max_tokens=32768),
        steps=800,
    ),
    # The nano-egg paper model: 6 layers, width 256, byte vocabulary, T = 100. The z-test
    # rule keeps the update on the CuPy backend's device path.
    "egg-paper": RunConfig(
        model=ModelConfig(n_layer=6, d_model=256),
        es=ESConfig(
            population=32768, chunk_size=4096, seq_len=100, sigma_shift=3, noise="gaussian"
        ),
        validation=ValidationConfig(every_steps=10, max_tokens=102400),
        steps=1000,
    ),
    # d-eggs' transformer on a BPE vocabulary of 2048 (`eggroll-data prepare --tokenizer bpe
    # --vocab-size 2048`), sized to learn on a 2-core CPU; only the 128 commonest tokens'
    # rows get noise (the others get too few votes to do better than a random walk), and a
    # head bias that starts at Zipf's law carries the marginal. Validation scores up to
    # 32,768 held-out tokens: the whole split of the built-in corpus, which the baselines
    # are measured on.
    "former-tiny": RunConfig(
        model=ModelConfig(arch="former", vocab_size=2048, n_layer=1, d_model=64, head_bias="zipf"),
        es=ESConfig(
            population=512,
            chunk_size=128,
            seq_len=16,
            sigma_shift=3,
            noise="gaussian",
            token_noise_rows=128,
        ),
        update=UpdateConfig(rule="momentum", momentum_shift=1),
        validation=ValidationConfig(every_steps=100, max_tokens=32768),
        steps=1000,
    ),
    # d-eggs' headline configuration: width 256, 4 layers of 4 heads, T = 64, vocabulary
    # 8192, 327,680 members in 8 chunks of 40,960, its uniform noise, its fitness filters,
    # quantised AdamW and adaptive noise (with d-eggs' bugs fixed). A GPU-sized run.
    "d-eggs": RunConfig(
        model=ModelConfig(arch="former", vocab_size=8192, n_layer=4, d_model=256, n_head=4),
        es=ESConfig(
            population=327680,
            chunk_size=40960,
            seq_len=64,
            sigma_shift=3,
            noise="uniform",
            adaptive_noise=True,
        ),
        fitness=FitnessConfig(chunk_mean_filter=True, adaptive_threshold=True),
        update=UpdateConfig(rule="adamw"),
        validation=ValidationConfig(every_steps=10, max_tokens=65536),
        steps=1000,
    ),
}


def preset_of(config: RunConfig) -> str | None:
    """The preset whose config this is, or None for any other config."""
    digest = config.digest()
    return next((name for name, cfg in PRESETS.items() if cfg.digest() == digest), None)


def preset(name: str) -> RunConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML config; a top-level `preset = "name"` supplies the defaults."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    base = None
    if "preset" in data:
        name = data.pop("preset")
        if not isinstance(name, str):
            raise ConfigError(
                f"'preset' must be a preset name ({', '.join(PRESETS)}), "
                f"got {type(name).__name__} {name!r}"
            )
        base = preset(name)
    return from_dict(data, base)


def resolve_config(preset_name: str | None, config_path: str | None) -> RunConfig:
    """The --preset / --config pair every command takes (a config file wins if both)."""
    if config_path:
        return load_config(config_path)
    return preset(preset_name or "tiny")
