"""`diff_runs`: lines matched by custom_id, compared on what the model answered, and the
summed log-probabilities of loglikelihood lines; beside them, what ran the two runs."""

from __future__ import annotations

from conveyor.wire_format.result_diff import answer_of, diff_runs, score_of, what_ran_changes


def chat_line(custom_id: str, content: str, finish: str = "stop", rid: str = "r1") -> dict:
    return {
        "id": f"batch_req_{rid}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": rid,
            "body": {
                "id": f"chatcmpl-{rid}",
                "created": 1,
                "model": "m",
                "choices": [
                    {"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": content}}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        },
        "error": None,
    }  # fmt: skip


def loglikelihood_line(custom_id: str, logprobs: list[float | None]) -> dict:
    choice = {
        "index": 0,
        "text": "The answer",
        "finish_reason": "length",
        "logprobs": {"tokens": ["The", " answer"], "token_logprobs": logprobs},
    }
    return {"custom_id": custom_id, "error": None,
            "response": {"status_code": 200, "body": {"choices": [choice]}}}  # fmt: skip


def test_what_differs_on_every_run_is_not_a_change():
    first = [chat_line("a", "yes", rid="r1"), chat_line("b", "no", rid="r2")]
    second = [chat_line("b", "no", rid="x9"), chat_line("a", "yes", rid="x8")]
    found = diff_runs(first, second)
    assert found.same == 2 and not found.differs


def test_changed_new_and_gone_lines():
    first = [chat_line("a", "yes"), chat_line("b", "no"), chat_line("c", "maybe")]
    second = [chat_line("a", "yes"), chat_line("b", "no", finish="length"), chat_line("d", "x")]
    found = diff_runs(first, second)
    assert [c.custom_id for c in found.changed] == ["b"]
    assert found.changed[0].before[0]["finish_reason"] == "stop"
    assert found.new == ["d"] and found.gone == ["c"] and found.same == 1
    errored = {"custom_id": "a", "response": None,
               "error": {"code": "invalid_request", "message": "..."}}  # fmt: skip
    assert diff_runs(first[:1], [errored]).changed[0].after == {"error": "invalid_request"}


def test_scores_that_moved_are_listed_largest_first_with_a_tolerance():
    first = [loglikelihood_line("x", [None, -1.0, -2.0]), loglikelihood_line("y", [None, -3.0])]
    second = [loglikelihood_line("x", [None, -1.0, -2.5]), loglikelihood_line("y", [None, -2.0])]
    assert score_of(first[0]) == -3.0
    found = diff_runs(first, second)
    assert [(s.custom_id, s.delta) for s in found.scores] == [("y", 1.0), ("x", -0.5)]
    assert found.differs and found.changed == [] and found.same == 0
    assert [s.custom_id for s in diff_runs(first, second, tolerance=0.6).scores] == ["y"]
    report = found.as_dict(top=1)
    assert report["score_changes"][0]["custom_id"] == "y" and report["score_changes_total"] == 2


def test_a_response_object_is_compared_on_its_output_items():
    def response(text: str) -> dict:
        body = {"id": "resp_1", "status": "completed", "output": [
            {"type": "message", "content": [{"type": "output_text", "text": text}]},
            {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"},
        ]}  # fmt: skip
        return {"custom_id": "r", "error": None, "response": {"status_code": 200, "body": body}}

    assert answer_of(response("hi"))["output"][1] == {"call": "f", "arguments": "{}"}
    assert diff_runs([response("hi")], [response("hi")]).same == 1
    assert len(diff_runs([response("hi")], [response("ho")]).changed) == 1


def run_record(worker: str, fingerprint: str = "fp-1", **engine: object) -> dict:
    """One entry of a batch's `reproducibility`, as the API gives it."""
    return {
        "worker": worker,
        "fingerprint": fingerprint,
        "first_at": float(len(worker)),
        "conveyor": "0.1.0",
        "engine": {"dtype": "bfloat16", "max_num_seqs": 256, **engine},
        "default_sampling": {"temperature": 1.0},
    }


def test_what_ran_two_runs_compares_all_but_the_worker_and_the_time():
    assert what_ran_changes([run_record("w1")], [run_record("w2")]) == []
    changes = what_ran_changes(
        [run_record("w1")], [run_record("w1", fingerprint="fp-2", dtype="float32")]
    )
    assert [(c.name, c.before, c.after) for c in changes] == [
        ("engine.dtype", ["bfloat16"], ["float32"]),
        ("fingerprint", ["fp-1"], ["fp-2"]),
    ]


def test_what_ran_a_run_of_several_workers_is_each_value_they_had():
    second = [run_record("w2", block_size=32), run_record("w1")]  # in any order
    (change,) = what_ran_changes([run_record("w1")], second)
    assert (change.name, change.before, change.after) == ("engine.block_size", [], [32])
    first = [run_record("w1"), run_record("w2", dtype="float32")]
    (change,) = what_ran_changes(first, [run_record("w3")])
    assert (change.before, change.after) == (["bfloat16", "float32"], ["bfloat16"])


def test_diff_runs_says_what_ran_them_only_where_both_are_known():
    lines = [chat_line("a", "yes")]
    assert diff_runs(lines, lines).what_ran is None
    assert diff_runs(lines, lines, first_ran=[], second_ran=[run_record("w")]).what_ran is None
    found = diff_runs(lines, lines, first_ran=[run_record("w1")], second_ran=[run_record("w2")])
    assert found.what_ran == [] and not found.differs
    assert found.as_dict(10)["what_ran_changed"] == []
    changed = diff_runs(lines, lines, 0.0, [run_record("w")], [run_record("w", "fp-2")])
    assert not changed.differs  # the answers are what counts; what ran them explains
    assert changed.as_dict(10)["what_ran_changed"] == [
        {"name": "fingerprint", "before": ["fp-1"], "after": ["fp-2"]}
    ]
