"""The echo engine: at once by default; paced like a model on other hardware when asked."""

from __future__ import annotations

import time

from conveyor.worker.echo import EchoEngine


def test_echo_answers_everything_in_one_step_by_default():
    engine = EchoEngine()
    for i in range(300):
        engine.add_request(f"r{i}", "a b c", None)
    done = engine.step()
    assert len(done) == 300 and not engine.has_unfinished()
    assert done[0].outputs[0].text == "a b c" and done[0].finished


def test_a_paced_echo_waits_each_step_and_caps_it_at_max_num_seqs():
    engine = EchoEngine(step_seconds=0.05, max_num_seqs=128)
    for i in range(300):
        engine.add_request(f"r{i}", [1, 2], None)
    sizes, start = [], time.perf_counter()
    while engine.has_unfinished():
        sizes.append(len(engine.step()))
    assert sizes == [128, 128, 44]
    assert time.perf_counter() - start >= 3 * 0.05
