"""Hypothesis strategies for request bodies with numbers of every size in them: the edges of
int32, int64 and uint64, huge integers, tiny and huge floats, long lists. Shared by the tests
that drive the request checks and the engine (tests/conveyor) and the running service
(tests/system)."""

from __future__ import annotations

from hypothesis import strategies as st

EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**19, -(2**63) - 1]
ANY_INT = st.one_of(st.integers(-3, 40), st.integers(), st.sampled_from(EDGES))
ANY_FLOAT = st.one_of(  # what JSON can carry: no NaN or infinity
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-3, max_value=3),
    st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 1e-5, 1.0, 2.0]),
)
IDS = st.lists(ANY_INT, max_size=5)
FIELDS = {
    "n": ANY_INT,
    "temperature": ANY_FLOAT,
    "top_p": ANY_FLOAT,
    "top_k": ANY_INT,
    "min_p": ANY_FLOAT,
    "seed": ANY_INT,
    "max_tokens": ANY_INT,
    "min_tokens": ANY_INT,
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=300)),
    "stop_token_ids": IDS,
    "presence_penalty": ANY_FLOAT,
    "frequency_penalty": ANY_FLOAT,
    "repetition_penalty": ANY_FLOAT,
    "logit_bias": st.dictionaries(ANY_INT.map(str), ANY_FLOAT, max_size=3),
    "allowed_token_ids": IDS,
    "ignore_eos": st.booleans(),
}
# what a client would send, seeds of any size among them: half of the bodies
SMALL_IDS = st.lists(st.integers(0, 60), min_size=1, max_size=5)
PLAUSIBLE = {
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.floats(min_value=1e-3, max_value=1.0),
    "top_k": st.integers(-1, 64),
    "min_p": st.floats(min_value=0.0, max_value=1.0),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": SMALL_IDS,
    "presence_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "frequency_penalty": st.floats(min_value=-2.0, max_value=2.0),
    "repetition_penalty": st.floats(min_value=0.1, max_value=3.0),
    "logit_bias": st.dictionaries(st.integers(0, 60).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": SMALL_IDS,
    "ignore_eos": st.booleans(),
}
CHAT_ONLY = {"logprobs": st.booleans(), "top_logprobs": ANY_INT, "max_completion_tokens": ANY_INT}
PROMPT = st.one_of(st.text(max_size=20), st.lists(ANY_INT, min_size=1, max_size=5))
COMPLETION_ONLY = {"logprobs": ANY_INT, "echo": st.booleans(), "best_of": ANY_INT}
PLAUSIBLE_COMPLETION = {"logprobs": st.integers(0, 5), "echo": st.booleans()}
COMPLETIONS = st.one_of(
    st.fixed_dictionaries({"prompt": PROMPT}, optional=FIELDS | COMPLETION_ONLY),
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(min_size=1, max_size=20), SMALL_IDS)},
        optional=PLAUSIBLE | PLAUSIBLE_COMPLETION,
    ),
)
CHATS = st.one_of(
    st.fixed_dictionaries({}, optional=FIELDS | CHAT_ONLY),
    st.fixed_dictionaries({}, optional=PLAUSIBLE | {"logprobs": st.booleans()}),
)
