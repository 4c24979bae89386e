"""The chat template: the checkpoint's or one given as a file or text, with the server's default
variables under each request's own (`chat_template_kwargs`); a template that does not parse
is refused at start, one that fails on a conversation is that request's 400, naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.config import EngineConfig, json_object
from conveyor.engine.errors import ChatTemplateError
from conveyor.request_outcome import prepare_request
from conveyor.wire_format.errors import CHAT_TEMPLATE_ERROR, RequestError
from conveyor.wire_format.request_line import parse_request_line
from tests.hf_reference import hf_greedy

THINKING = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no thinking]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]


def rendered(llm: LLM, messages=HI, **kwargs) -> str:
    return llm.tokenizer.decode(llm.apply_chat_template(messages, chat_template_kwargs=kwargs))


@pytest.fixture
def template_file(tmp_path: Path) -> Path:
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING)
    return path


def test_a_template_file_with_default_variables_under_the_requests(checkpoints, template_file):
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32",
              chat_template=str(template_file),
              default_chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert rendered(llm) == "<user>hi[no thinking]<assistant>"
    assert rendered(llm, enable_thinking=True) == "<user>hi<assistant>"  # the request's wins


def test_template_text_and_the_checkpoints_own(checkpoints):
    path = str(checkpoints["llama"])
    given = LLM(path, device="cpu", dtype="float32", chat_template=THINKING)
    assert rendered(given, enable_thinking=False) == "<user>hi[no thinking]<assistant>"
    own = LLM(path, device="cpu", dtype="float32")
    assert own.tokenizer.chat_template and rendered(own) != rendered(given)
    assert rendered(own) == own.tokenizer.apply_chat_template(
        HI, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize(
    "given, defaults, message",
    [
        ("{% for m in messages %}{{ m }", None, r"not a valid Jinja template: line 1"),
        ("no-such-template.jinja", None, "is neither a file nor a Jinja template"),
        (None, {"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ],
)
def test_a_template_or_defaults_that_cannot_work_are_refused_at_start(
    checkpoints, given, defaults, message
):
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", chat_template=given,
            default_chat_template_kwargs=defaults)  # fmt: skip


def test_a_failing_render_is_the_requests_400_naming_the_template(checkpoints, template_file):
    strict = template_file.parent / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
                      "messages here') }}{% endif %}{{ messages[0]['content'] }}")  # fmt: skip
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", chat_template=str(strict))

    def prepared(**body):
        line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": HI, **body}}  # fmt: skip
        return prepare_request(llm, parse_request_line(json.dumps(line), line=3))

    with pytest.raises(RequestError) as info:
        prepared(messages=[{"role": "system", "content": "s"}])
    err = info.value
    assert (err.code, err.param, err.status_code) == (CHAT_TEMPLATE_ERROR, "body.messages", 400)
    assert f"the chat template {strict} could not render" in err.message
    assert "no system messages here" in err.message
    with pytest.raises(RequestError) as info:
        prepared(chat_template_kwargs={"tokenize": True})
    assert info.value.param == "body.chat_template_kwargs"
    assert "may not set 'tokenize'" in info.value.message
    prompt, _ = prepared(chat_template_kwargs={"enable_thinking": False})
    assert llm.tokenizer.decode(prompt.token_ids) == "hi"
    with pytest.raises(ChatTemplateError):
        llm.apply_chat_template([{"role": "system", "content": "s"}])


def test_the_default_variables_come_from_the_command_line():
    assert json_object('{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(Exception, match="want a JSON object"):
        json_object("[1]")
    with pytest.raises(Exception, match="not JSON"):
        json_object("{enable_thinking: false}")
    assert EngineConfig().default_chat_template_kwargs is None


def test_continue_final_message_leaves_the_last_message_open(checkpoints):
    """As transformers renders it: the last message without its end of turn and no new turn,
    and the model goes on with it (vLLM's `continue_final_message`)."""
    path = checkpoints["llama"]
    llm = LLM(str(path), device="cpu", dtype="float32")
    conversation = [*HI, {"role": "assistant", "content": "The answer is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids = llm.apply_chat_template(conversation, **options)
    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    assert llm.tokenizer.decode(ids) == text and text.endswith("The answer is")
    closed = llm.apply_chat_template(conversation, add_generation_prompt=False)
    assert len(closed) > len(ids)  # the message's end of turn
    params = SamplingParams(temperature=0, max_tokens=5)
    (out,) = llm.chat(conversation, params, use_tqdm=False, **options)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(path, ids, 5)
