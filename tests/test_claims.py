"""The coordinator's claims (coordinator/claims.py): what a Hugging Face reward run keeps of
each result's completions, what it refuses, and what a checker is sent."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from eggroll_dist.coordinator.claims import MAX_CLAIM_TOKENS, MAX_CLAIMS, Claims, too_large
from eggroll_dist.protocol import messages
from eggroll_dist.shared.config import ESConfig, FitnessConfig, ModelConfig, RunConfig
from eggroll_dist.shared.fitness import checked_by_claims
from eggroll_dist.worker.session import Session
from eggroll_dist.worker.session_types import Evaluate, PeerViolation, Phase

REWARD = FitnessConfig(
    objective="reward", reward="builtin:letter_e", prompts="p.txt", prompts_per_step=2,
    completion_tokens=3,
)  # fmt: skip
CFG = RunConfig(
    model=ModelConfig(arch="hf", path="tiny", rank=2),
    es=ESConfig(population=8, chunk_size=4, sigma=0.01),
    fitness=REWARD,
)
IDS = 4 * 2 * 3  # members x prompts x tokens of a chunk


def claim(step: int, chunk: int, value: int, n: int = IDS) -> messages.Claim:
    return messages.Claim.from_ids(step, chunk, np.full(n, value))


def test_only_reward_runs_of_inexact_models_are_checked_by_claims() -> None:
    assert checked_by_claims(CFG)
    assert not checked_by_claims(replace(CFG, fitness=FitnessConfig()))  # next-token loss
    int8 = RunConfig(es=ESConfig(population=8, chunk_size=4), fitness=REWARD)
    assert not checked_by_claims(int8)  # exact everywhere: compared byte for byte


def test_a_claim_is_refused_unless_it_is_a_held_chunk_of_the_open_step_and_the_runs_size() -> None:
    claims = Claims(CFG)
    claims.start(5)
    assert claims.problem(claim(5, 1, 7), held=True) is None
    assert "not leased" in str(claims.problem(claim(5, 1, 7), held=False))
    assert "not yet open" in str(claims.problem(claim(6, 1, 7), held=True))
    assert claims.problem(claim(4, 1, 7), held=False) is None  # stale: dropped quietly
    too_many = claims.problem(claim(5, 1, 7, IDS + 1), held=True)
    assert too_many is not None and f"writes {IDS}" in too_many
    claims.put("w", claim(4, 1, 7))  # a stale one is not kept
    assert claims.take("w", 1) is None


def test_each_distinct_result_keeps_its_first_claim_and_a_checker_gets_them_in_order() -> None:
    claims = Claims(CFG)
    claims.start(2)
    results = [(bytes([i]), i) for i in range(MAX_CLAIMS + 1)]
    for i, key in enumerate(results):
        claims.put(f"w{i}", claim(2, 0, i))
        tokens = claims.take(f"w{i}", 0)
        assert tokens is not None and claims.take(f"w{i}", 0) is None  # taken once
        claims.attach(0, key, tokens)
    claims.attach(0, results[0], claim(2, 0, 99).tokens)  # the same result again: kept once
    votes = {key: [f"w{i}"] for i, key in enumerate(results)}
    sent = claims.to_check(2, 0, votes)
    assert [int(c.ids()[0]) for c in sent] == list(range(MAX_CLAIMS))  # the first, in order
    assert all((c.step, c.chunk) == (2, 0) for c in sent)
    # a result whose votes were dropped (its worker convicted) is not sent to be checked
    votes[results[1]] = []
    assert [int(c.ids()[0]) for c in claims.to_check(2, 0, votes)] == [0, 2]
    assert claims.to_check(2, 1, votes) == [] and claims.to_check(3, 0, votes) == []
    claims.settled(0)  # decided: freed
    assert claims.to_check(2, 0, votes) == []
    claims.start(3)  # a new step (or a rewind): nothing is kept
    assert claims.to_check(3, 0, votes) == []


def test_a_leaving_workers_pending_claims_are_forgotten() -> None:
    claims = Claims(CFG)
    claims.start(0)
    claims.put("a", claim(0, 0, 1))
    claims.put("b", claim(0, 1, 2))
    claims.forget("a")
    assert claims.take("a", 0) is None
    assert claims.take("b", 1) is not None


def test_a_reward_run_whose_claims_outgrow_a_frame_is_refused_by_the_coordinator() -> None:
    """A coordinator refuses to serve it (one line); one process (eggroll-tune) sends no
    claims, so the config itself stays valid."""
    wide = replace(REWARD, prompts_per_step=1024, completion_tokens=8)
    cfg = replace(CFG, es=ESConfig(population=2048, chunk_size=1024, sigma=0.01), fitness=wide)
    assert too_large(cfg) == (
        "es.chunk_size * fitness.prompts_per_step * fitness.completion_tokens is 8,388,608 "
        "tokens a chunk; a Hugging Face model's reward run sends them with each result, at most "
        f"{MAX_CLAIM_TOKENS:,}: lower es.chunk_size"
    )
    assert MAX_CLAIM_TOKENS == 4_194_301
    assert too_large(CFG) is None


def test_a_worker_keeps_claims_for_its_next_jobs_and_refuses_what_no_run_sends() -> None:
    """worker/session.py: CLAIMs before a JOB go with it to the evaluation; a claim of the
    wrong size, more than MAX_CLAIMS for a chunk, or one in a run checked without them is a
    protocol violation; one for another step is dropped with its JOB."""
    s = Session(SimpleNamespace(), SimpleNamespace(step=2))  # type: ignore[arg-type]
    s.config, s.phase = CFG, Phase.IDLE
    assert s.receive(claim(3, 0, 5)) == []  # another step: dropped
    for value in range(MAX_CLAIMS):
        assert s.receive(claim(2, 1, value)) == []
    with pytest.raises(PeerViolation, match="more CLAIMs"):
        s.receive(claim(2, 1, 9))
    with pytest.raises(PeerViolation, match=f"a chunk writes {IDS}"):
        s.receive(claim(2, 0, 5, IDS - 1))
    [evaluate] = s.receive(messages.Job(2, 1, 4, 4, 0))
    assert isinstance(evaluate, Evaluate)
    [held] = evaluate.claims
    assert [int(t[0, 0, 0]) for t in held] == list(range(MAX_CLAIMS))
    assert held[0].shape == (4, 2, 3)  # members, prompts, tokens
    s.config = RunConfig(es=ESConfig(population=8, chunk_size=4))  # exact: never claimed
    s.phase = Phase.IDLE
    with pytest.raises(PeerViolation, match="not checked through claims"):
        s.receive(claim(2, 0, 5))
