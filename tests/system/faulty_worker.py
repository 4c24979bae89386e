"""Run `conveyor` with a faulty engine under its worker, for the isolation tests:

    python tests/faulty_worker.py [FAULTS] -- worker --model echo ...

The worker's engine (the echo engine in the tests) is wrapped so that it fails the way real
engines and tokenizers do; everything else is the real `conveyor worker`. FAULTS:

  --fail-after-steps N        every step after the N-th raises (the model's forward failed)
  --fail-while-in-flight TEXT  a step raises while a request whose prompt holds TEXT is in
                              the engine (a request that kills the engine every time)
  --refuse-prompt-with TEXT   adding a request whose prompt holds TEXT raises TypeError (as a
                              tokenizer does on a lone surrogate)
  --surrogate-text-for TEXT   the output text of a prompt holding TEXT ends in a lone
                              surrogate (as model text can)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import conveyor.worker.main
from conveyor.cli import main
from conveyor.engine.config import EngineConfig


class FaultyEngine:
    def __init__(self, engine: Any, faults: argparse.Namespace) -> None:
        self.engine, self.faults = engine, faults
        self.steps = 0
        self.prompts: dict[str, str] = {}  # request id -> prompt text, while in the engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt: Any, params: Any, **options: Any) -> None:
        text = prompt if isinstance(prompt, str) else getattr(prompt, "text", None) or ""
        if self.faults.refuse_prompt_with and self.faults.refuse_prompt_with in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[...]]")
        self.engine.add_request(request_id, prompt, params, **options)
        self.prompts[request_id] = text

    def abort(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.engine.abort(request_id)

    def step(self) -> list[Any]:
        self.steps += 1
        after = self.faults.fail_after_steps
        if after is not None and self.steps > after:
            raise RuntimeError(f"the model's forward pass failed (step {self.steps})")
        marker = self.faults.fail_while_in_flight
        if marker and any(marker in text for text in self.prompts.values()):
            raise RuntimeError("the model's forward pass failed on a poisoned request")
        outputs = self.engine.step()
        for output in outputs:
            text = self.prompts.pop(output.request_id, "")
            marker = self.faults.surrogate_text_for
            if marker and marker in text:
                output.outputs[0].text += " \udc80"
        return outputs


def run(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="faulty_worker")
    parser.add_argument("--fail-after-steps", type=int)
    parser.add_argument("--fail-while-in-flight")
    parser.add_argument("--refuse-prompt-with")
    parser.add_argument("--surrogate-text-for")
    faults = parser.parse_args(argv[:split])
    build_engine = conveyor.worker.main.build_engine

    def faulty_build_engine(model: str, config: EngineConfig) -> Any:
        return FaultyEngine(build_engine(model, config), faults)

    conveyor.worker.main.build_engine = faulty_build_engine
    return main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
