"""The OpenAI Batch file format, apart from how it is served, stored or run: no torch, no
database, no web framework (a test holds it to that).

One input line is a JSON object::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

- `errors`: every error code a client can see, and `BatchRequestError`;
- `bodies`: the request bodies of the two endpoints, type- and range-checked;
- `body_text`: what no body may hold (lone surrogates, nesting too deep);
- `request_line`: one line checked into a `ParsedRequest`, and a file's lines in order;
- `lines`: what a line of a file is, counted alike at upload and at validation;
- `validation`: a whole file checked by OpenAI's rules (what fails the batch, what one line);
- `prefix`: what requests that can share KV blocks have in common;
- `token_text`: token ids as text and bytes, for logprobs;
- `responses`: the completion objects built from the engine's outputs;
- `result_lines`: output and error lines, and their JSON text.
"""
