"""The OpenAI wire format, batch and online alike, apart from how it is served, stored or run:
request bodies, batch lines and files, completion objects and stream chunks, result and error
lines, every error code. No torch, no database, no web framework (a test holds it to that).

One batch input line is a JSON object::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

- `errors`: every error code a client can see, and `RequestError`;
- `bodies`: the request bodies of the endpoints, type- and range-checked;
- `fields`: every body field a client may send, and what Conveyor does with it;
- `text`: what no body may hold (lone surrogates, NUL where text is stored, nesting too deep);
- `request_line`: one line checked into a `ParsedRequest`, and a file's lines in order;
- `lines`: what a line of a file is, counted alike at upload and at validation;
- `validation`: a whole file checked by OpenAI's rules (what fails the batch, what one line);
- `prefix`: what requests that can share KV blocks have in common;
- `token_text`: token ids as text and bytes, for logprobs;
- `reasoning`: a reasoning model's thinking split from its answer;
- `tools`, `tool_calls`, `tool_use`: a chat's tools and tool_choice, the parsers of the calls
  models write, and how an answer is read for calls;
- `responses`: the completion objects built from the engine's outputs;
- `streaming`: the chunks of a streamed online answer;
- `responses_body`, `response_object`, `response_events`: OpenAI's Responses API, its body
  translated into a chat completion's, and the chat answer (and its chunks) back into the
  Response object (and its typed stream events);
- `result_lines`: output and error lines, and their JSON text.
"""
