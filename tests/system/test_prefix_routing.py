"""Prefix sharing across a fleet: shards with the same prefix go to the same worker."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import sqlalchemy as sa

from conveyor.dispatch.routing import owner
from conveyor.testing import Stack, batch_lines, wait_for, write_jsonl
from conveyor.wire_format.prefix import prefix_key
from conveyor.wire_format.request_line import parse_request_object
from tests.system.test_service import submit
from tests.system.test_service_recovery import (
    assert_each_once,
    ledger,
    result_count,
    wait_results,
    worker_stats,
)


def systems_owned_by(workers: list[str]) -> list[str]:
    """One system prompt per worker, found by trying until the hash spreads them."""
    found: dict[str, str] = {}
    i = 0
    while len(found) < len(workers):
        system = f"You are assistant number {i}. Think step by step."
        line = batch_lines(1, system=system)[0]
        key = prefix_key(parse_request_object(line))
        found.setdefault(owner(key, sorted(workers)), system)
        i += 1
    return [found[w] for w in workers]


def workers_per_system(stack: Stack, batch_ids: list[str]) -> dict[str, set[str]]:
    engine = ledger(stack)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.raw, x.worker FROM requests r JOIN results x ON x.request_id = r.id "
                "WHERE r.batch_id = ANY(:ids)"
            ),
            {"ids": batch_ids},
        ).all()
    engine.dispose()
    out: dict[str, set[str]] = defaultdict(set)
    for raw, worker in rows:
        out[json.loads(raw)["body"]["messages"][0]["content"]].add(worker)
    return out


def test_each_system_prompt_runs_on_one_worker(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    stack.start_worker("w1", chat_model, "--concurrency", "4")
    stack.start_worker("w2", chat_model, "--concurrency", "4")
    sys_a, sys_b = systems_owned_by(["w1", "w2"])
    batches = []
    for i, system in enumerate([sys_a, sys_b, sys_a, sys_b]):
        lines = batch_lines(16, system=system, prefix=f"b{i}", max_tokens=8)
        batches.append((submit(api, write_jsonl(tmp_path / f"{i}.jsonl", lines)), lines))
    for batch, lines in batches:
        done = wait_for(api, batch["id"])
        assert done["status"] == "completed"
        assert_each_once(api, done, lines)
    placement = workers_per_system(stack, [b["id"] for b, _ in batches])
    assert placement == {sys_a: {"w1"}, sys_b: {"w2"}}
    # the workers' own accounts agree: each prefix key ran on one worker, and its KV was
    # computed there once and then served from that worker's cache
    time.sleep(2.5)  # stats are published every second
    stats = {w: worker_stats(stack, w) for w in ("w1", "w2")}
    keys = {w: set(s["shard_prefixes"]) for w, s in stats.items()}
    assert keys["w1"] and keys["w2"] and not keys["w1"] & keys["w2"]
    for s in stats.values():
        assert s["prompt_tokens_cached"] > 0


def test_killing_one_worker_moves_its_share(stack: Stack, chat_model: Path, tmp_path: Path):
    api = stack.start_api()
    # w1 runs 4 sequences at a time, whatever the machine's speed
    stack.start_worker("w1", chat_model, "--concurrency", "2", "--max-num-seqs", "4")
    stack.start_worker("w2", chat_model, "--concurrency", "2")
    sys_a, sys_b = systems_owned_by(["w1", "w2"])
    batches = []
    # every line runs its full length (a random model can emit EOS within a few tokens), so w1
    # takes 20 rounds of 4 sequences x 96 steps for its share: when its first results appear,
    # most rounds are left, far more than the time between the poll and the kill (with 16
    # sequences at a time, a fast machine finished the share before the kill)
    for i, system in enumerate([sys_a, sys_b, sys_a, sys_b]):
        lines = batch_lines(40, system=system, prefix=f"k{i}", max_tokens=96)
        for line in lines:
            line["body"]["ignore_eos"] = True
        batches.append((submit(api, write_jsonl(tmp_path / f"{i}.jsonl", lines)), lines))
    wait_results(stack, batches[0][0]["id"], 3)
    stack.kill("w1")
    share_a = [batches[0][0]["id"], batches[2][0]["id"]]
    done_a = sum(result_count(stack, batch_id) for batch_id in share_a)
    assert done_a < 80, "w1 finished its whole share before the kill: nothing left to move"
    for batch, lines in batches:
        done = wait_for(api, batch["id"], timeout=300)
        assert done["status"] == "completed"
        assert done["request_counts"]["failed"] == 0
        assert_each_once(api, done, lines)
    placement = workers_per_system(stack, [b["id"] for b, _ in batches])
    assert "w2" in placement[sys_a]  # w1's share moved to the live worker
