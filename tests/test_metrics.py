"""The coordinator's metrics as a scrape would read them, from a registry of their own: a
small run driven in memory through the real shell (tests/helpers.py), whose executor feeds
the run core's events to `Metrics`. No Prometheus binary, no sockets."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Network
from prometheus_client import CollectorRegistry

from eggroll_dist.coordinator.events import Committed, Sampled
from eggroll_dist.coordinator.metrics import Metrics
from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol import ErrorCode, Validation
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.data import Dataset, load_data_dir

# Two chunks of 8 members a step; a held-out score every second step.
CFG = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16),
    es=ESConfig(population=16, chunk_size=8, seq_len=8),
    validation=ValidationConfig(every_steps=2, max_tokens=64),
)
STEP_TOKENS = CFG.es.population * CFG.es.seq_len


@pytest.fixture(scope="module")
def dataset(words_data: Path) -> Dataset:
    return load_data_dir(words_data)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    s = RunStore.open(tmp_path / "run", CFG)
    yield s
    s.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_a_run_is_measured_as_it_trains(
    store: RunStore, dataset: Dataset, registry: CollectorRegistry
) -> None:
    net = Network(store, dataset, metrics=Metrics(registry), snapshot_every=2, sample_every=2)
    a, b = net.join("a"), net.join("b")
    net.train(3)
    net.run()
    value = registry.get_sample_value

    run = {"run_id": store.run_id.hex(), "config_digest": CFG.digest().hex()}
    assert value("eggroll_run_info", run) == 1
    assert value("eggroll_step") == 3
    assert value("eggroll_steps_committed_total") == 3
    assert value("eggroll_workers_connected") == 2
    assert value("eggroll_step_duration_seconds_count") == 3
    assert value("eggroll_member_tokens_total") == 3 * STEP_TOKENS
    last = net.latest(Committed)
    assert last is not None and last.step == 2
    assert value("eggroll_train_loss_bits") == last.loss_bits > 0
    assert value("eggroll_last_commit_timestamp_seconds") > 0
    # Every chunk of the three steps leased and completed, none re-queued or dropped.
    assert value("eggroll_chunks_completed_total") == 3 * CFG.chunks
    assert value("eggroll_chunks_leased_total") >= 3 * CFG.chunks
    assert value("eggroll_chunks_requeued_total", {"reason": "disconnect"}) == 0
    assert value("eggroll_results_dropped_total", {"reason": "stale"}) == 0
    per_worker = {w: value("eggroll_worker_member_tokens_total", {"worker": w}) for w in "ab"}
    assert sum(v or 0 for v in per_worker.values()) == 3 * STEP_TOKENS
    results = value("eggroll_network_bytes_total", {"direction": "in", "type": "RESULT"})
    steps = value("eggroll_network_bytes_total", {"direction": "out", "type": "STEP"})
    assert results > 0 and steps > 0
    # The held-out score of step 2, exactly as the worker asked sent it.
    (score,) = [m for w in (a, b) for m in w.sent if isinstance(m, Validation)]
    assert value("eggroll_valid_step") == 2
    assert value("eggroll_valid_bits_per_token") == score.bits_per_token
    assert value("eggroll_valid_stream_bits_per_token") == score.stream_bits_per_token
    # The snapshot of step 2, received and stored; the sample of step 2 shown.
    assert value("eggroll_snapshot_transfers_total", {"direction": "in"}) == 1
    assert value("eggroll_last_snapshot_timestamp_seconds") > 0
    sample = net.latest(Sampled)
    assert sample is not None and sample.step == 2
    labels = {"step": "2", "worker": sample.worker, "prompt": sample.prompt, "text": sample.text}
    assert value("eggroll_sample_info", labels) == 1

    a.close("gone")
    assert value("eggroll_workers_connected") == 1
    assert value("eggroll_worker_member_tokens_total", {"worker": "a"}) is None  # removed


def test_unknown_values_are_nan_until_measured(
    store: RunStore, dataset: Dataset, registry: CollectorRegistry
) -> None:
    Network(store, dataset, metrics=Metrics(registry))
    value = registry.get_sample_value
    assert value("eggroll_step") == 0 and value("eggroll_workers_connected") == 0
    for name in ("eggroll_train_loss_bits", "eggroll_valid_bits_per_token"):
        assert math.isnan(value(name))
    assert math.isnan(value("eggroll_weights_changed"))


def test_refusals_requeues_and_divergence_are_counted(
    store: RunStore, dataset: Dataset, registry: CollectorRegistry
) -> None:
    net = Network(store, dataset, metrics=Metrics(registry), token=b"s3cret")
    value = registry.get_sample_value
    intruder = net.join("intruder", token=b"wrong")
    net.run()
    assert intruder.fatal is not None
    assert value("eggroll_protocol_errors_total", {"code": "AUTH_FAILED"}) == 1

    gone, a, _ = (net.join(name, token=b"s3cret") for name in ("gone", "a", "b"))
    gone.hold_jobs = True
    net.run()
    assert gone.held
    gone.close("gone")  # its chunk goes back to the queue, and on to another worker
    assert value("eggroll_chunks_requeued_total", {"reason": "disconnect"}) == 1
    net.train(2)
    assert value("eggroll_steps_committed_total") == 2
    assert value("eggroll_weights_changed") > 0  # reported with the agreed replica

    a.replica.digest ^= 1  # a replica that no longer agrees: its RESULT says so
    a.finish_held()
    net.run()
    assert (a.name, ErrorCode.DIVERGED) in net.refused
    assert value("eggroll_protocol_errors_total", {"code": "DIVERGED"}) == 1
    assert value("eggroll_replica_digest_mismatches_total") == 1
    assert value("eggroll_results_dropped_total", {"reason": "diverged"}) == 1
    assert value("eggroll_workers_connected") == 1


def test_a_reward_run_sets_its_reward_gauges_not_the_loss(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry)
    value = registry.get_sample_value
    metrics.committed(0.5, math.nan, 4096, reward=0.25)
    assert value("eggroll_train_reward") == 0.25 and math.isnan(value("eggroll_train_loss_bits"))
    metrics.validated(Validation(2, 64, 70.0, 4.5, 64, 0, 0.0, 0.0, 0, 8, -0.5))
    assert value("eggroll_valid_reward") == -0.5
    metrics.validated(Validation(4, 64, 70.0, 4.5, 64))  # a loss run's: no reward to show
    assert value("eggroll_valid_reward") == -0.5


def test_a_workers_series_outlive_its_old_session_but_not_the_last(
    store: RunStore, dataset: Dataset, registry: CollectorRegistry
) -> None:
    """A worker reconnects under its name while its old session lingers: the old one's
    end keeps the series the new one feeds; the last one's end removes them."""
    net = Network(store, dataset, metrics=Metrics(registry))
    old, new = net.join("w", host="10.0.0.1"), net.join("w", host="10.0.0.2")
    net.train(2)
    series = "eggroll_worker_member_tokens_per_second"
    assert registry.get_sample_value(series, {"worker": "w"}) is not None
    net.disconnect(old)
    assert registry.get_sample_value(series, {"worker": "w"}) is not None
    net.disconnect(new)
    assert registry.get_sample_value(series, {"worker": "w"}) is None
