"""The step-level engine: add requests, step, collect finished outputs."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.chat_template import ChatTemplate, tool_call_parser_of
from conveyor.engine.config import EngineConfig
from conveyor.engine.cpu_memory import reuse_large_allocations, total_memory_bytes
from conveyor.engine.cuda_graphs import cuda_capture
from conveyor.engine.device_plan import DevicePlan, plan_device
from conveyor.engine.dtypes import resolve_dtype
from conveyor.engine.errors import (
    ContextLengthError,
    InvalidPromptError,
    InvalidSamplingParamsError,
    StructuredOutputError,
)
from conveyor.engine.fingerprint import engine_version, model_fingerprint
from conveyor.engine.kv_layout import KVLayout
from conveyor.engine.loader import (
    config_dtype,
    default_sampling,
    eos_token_ids,
    float32_weight_bytes,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from conveyor.engine.memory_profile import kv_cache_bytes, largest_step, peak_step_bytes
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.models import DecoderForCausalLM
from conveyor.engine.models.layers import LongRope
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import RequestOutput, TokenLogprobs
from conveyor.engine.prompt_logprobs import PromptLogprobs
from conveyor.engine.protocol import Prompt, TokenizedPrompt
from conveyor.engine.sampler import Sampler, SampleRequest, SampleResult, draw_label
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Request, Sequence
from conveyor.engine.structured_output import StructuredOutputs
from conveyor.kernels import get_attention_backend
from conveyor.kernels.backend import AttentionBackend
from conveyor.kernels.upload import to_device, upload

DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # blocks holding reusable prefix KV, in use or free
    num_running: int
    num_waiting: int
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    generation_tokens: int
    num_preemptions: int
    num_steps: int
    kv_blocks_saved: int = 0  # prompt blocks shared from the prefix cache instead of computed
    num_deferred: int = 0  # admissions put off to reuse a prefix being computed
    kv_bytes_per_token: int = 0  # what one more token of a long context holds in the KV cache

    @property
    def prompt_tokens_total(self) -> int:
        return self.prompt_tokens_computed + self.prompt_tokens_cached


class LLMEngine:
    def __init__(self, model: str, config: EngineConfig | None = None, **options: Any):
        """Load `model` (a directory or Hugging Face id) under `config`, or under the config
        that `options` (`max_num_seqs=8`, `dtype="float32"`, ...) make with the defaults."""
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise TypeError("give either an EngineConfig or engine options, not both")
        self.engine_config = config
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu":
            reuse_large_allocations()
        net = self._load_model(model)
        backend = get_attention_backend(config.attention_backend, self.device)
        self.plan = self._plan(net, backend)
        net.use_elementwise(self.plan.elementwise)
        net.use_experts(self.plan.experts)
        if config.batch_invariant:
            net.use_batch_invariance()
        self.fingerprint = self._fingerprint()
        self.kv_layout = KVLayout.of(net.layer_windows(), config.hybrid_kv_cache)
        num_kv_blocks = self._num_kv_blocks(net, backend)
        self.kv_bytes_per_token = self.kv_layout.context_token_bytes(
            ModelRunner.layer_block_bytes(net, 1, self.dtype)
        )
        self.max_model_len = self._max_model_len(num_kv_blocks)
        self.block_size = config.block_size

        # one more block where windowed sequences give blocks back: NULL_BLOCK, never handed out
        pool_blocks = num_kv_blocks + any(w is not None for w in self.kv_layout.windows)
        self.scheduler = self._make_scheduler(pool_blocks)
        self.runner = ModelRunner(
            net, backend, pool_blocks, config.block_size, self.device, self.dtype, self.kv_layout,
            batch_invariant=config.batch_invariant,
        )  # fmt: skip
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator, self.plan.sampling)
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.vocab_size, self.eos_token_ids
        )
        self.prompt_logprobs = PromptLogprobs(
            self.block_manager,
            net,
            PromptLogprobs.chunk_rows_for(
                config.prompt_logprobs_memory, self.vocab_size, self.dtype
            ),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, self.max_model_len
        )
        self.requests: dict[str, Request] = {}
        self.generation_tokens = 0
        self.num_steps = 0

    def _make_scheduler(self, pool_blocks: int) -> Scheduler:
        """The block manager over `pool_blocks` (`self.block_manager`) and the scheduler."""
        config = self.engine_config
        self.block_manager = BlockManager(
            pool_blocks, config.block_size, config.enable_prefix_caching,
            windows=self.kv_layout.windows,
        )  # fmt: skip
        return Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            cache_aware=config.admission_policy == "cache_aware",
            lpm_max_waiting=config.lpm_max_waiting,
            max_waiting_time=config.max_waiting_time,
            urgent_share=config.urgent_share,
        )

    def _load_model(self, model: str) -> DecoderForCausalLM:
        """Load the model's config, tokenizer and weights, once max_model_len fits the model."""
        path = resolve_model_path(model)
        self.model_path = path
        hf_config = load_config(path)
        self.config = hf_config  # the model's; the engine's own is self.engine_config
        self.dtype = resolve_dtype(
            self.engine_config.dtype, config_dtype(hf_config), self.device,
            lambda: float32_weight_bytes(path),
        )  # fmt: skip
        self.tokenizer = load_tokenizer(path)
        self.eos_token_ids = eos_token_ids(path, hf_config, self.tokenizer)
        c = self.engine_config
        self.chat_template = ChatTemplate.load(
            c.chat_template, c.default_chat_template_kwargs, path
        )
        self.reasoning_parser = c.reasoning_parser  # used by the service's chat responses
        # likewise; without the flag, the one the chat template's markers call for
        self.tool_call_parser = c.tool_call_parser or self._template_tool_call_parser()
        # what a request that omits a sampling field gets (`get_default_sampling_params`)
        self.default_sampling: dict[str, Any] = (
            default_sampling(path) if c.generation_config == "auto" else {}
        )
        self.vocab_size = hf_config.vocab_size

        max_model_len = self.engine_config.max_model_len
        max_positions = hf_config.max_position_embeddings
        if max_model_len is not None and max_model_len > max_positions:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={max_positions}"
            )
        self.model_len_limit = max_positions
        return load_model(path, hf_config, self.dtype, self.device, max_positions)

    def served_chat_template(self) -> str | dict[str, str] | None:
        """The template chats are rendered with: --chat-template's, else the tokenizer's."""
        return self.chat_template.text or getattr(self.tokenizer, "chat_template", None)

    def _template_tool_call_parser(self) -> str | None:
        template = self.served_chat_template()
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or template.get("tool_use")
        parser = tool_call_parser_of(template if isinstance(template, str) else None)
        if parser is not None:
            log.info("tool calls read with the %s parser, as the chat template writes them", parser)
        return parser

    def _fingerprint(self) -> str:
        """What decides this engine's answers, hashed (`engine.fingerprint`)."""
        c = self.engine_config
        numerics = {
            "conveyor": engine_version(),
            "dtype": str(self.dtype),
            "device": self.device.type,
            # the dtype is above; out of the plan's entry, so that the hash stays what it was
            # before the plan named it
            "plan": {k: v for k, v in self.plan.as_dict().items() if k != "dtype"},
            "batch_invariant": c.batch_invariant,
            "sampling": draw_label(self.plan.sampling),
            "generation_config": c.generation_config,
            "chat_template_kwargs": self.chat_template.defaults,
        }
        fingerprint = model_fingerprint(self.model_path, self.chat_template.text, numerics)
        log.info("model fingerprint: %s", fingerprint)
        return fingerprint

    def _plan(self, net: DecoderForCausalLM, backend: AttentionBackend) -> DevicePlan:
        """How each piece of the model runs on this device, logged once."""
        # the native activation covers a width that is a multiple of 16: it covers every
        # width of the model (dense and expert MLPs) when it covers their common divisor
        intermediate = math.gcd(*net.activation_widths())
        plan = plan_device(
            self.device, self.dtype, backend.name, elementwise=self.engine_config.elementwise,
            hidden=net.model.embed_tokens.weight.shape[1], head_dim=net.head_dim,
            intermediate=intermediate, experts=self.engine_config.experts,
            sampling=self.engine_config.sampling,
            expert_inter=math.gcd(*widths) if (widths := net.expert_widths()) else None,
        )  # fmt: skip
        log.info("engine plan: %s", plan.describe())
        return plan

    def _num_kv_blocks(self, net: DecoderForCausalLM, backend: AttentionBackend) -> int:
        """The configured number of KV cache blocks, else as many as the memory budget holds."""
        c = self.engine_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = self.kv_layout.block_bytes(
            ModelRunner.layer_block_bytes(net, c.block_size, self.dtype)
        )
        kv_bytes = c.kv_cache_memory
        if kv_bytes is None and self.device.type == "cuda":
            kv_bytes = self._gpu_kv_bytes(net, backend)
        num_kv_blocks = self._budget_blocks(kv_bytes, per_block)
        # never more than max_num_seqs sequences of full length can use, in every group
        blocks_per_seq = -(-self._longest() // c.block_size) * self.kv_layout.num_groups
        return min(num_kv_blocks, c.max_num_seqs * blocks_per_seq)

    def _longest(self) -> int:
        """The longest sequence asked for: --max-model-len, else the model's positions."""
        return self.engine_config.max_model_len or self.model_len_limit

    def _max_model_len(self, num_kv_blocks: int) -> int:
        """The configured max_model_len, else the model's, capped by what the KV cache holds
        (all of a sequence's blocks in every group, even where a window lets it give most back:
        a prompt chunk takes blocks for all its tokens before the window moves past them)."""
        max_model_len, block_size = self.engine_config.max_model_len, self.engine_config.block_size
        capacity = num_kv_blocks // self.kv_layout.num_groups * block_size
        if max_model_len is None:
            return min(self.model_len_limit, capacity)
        if max_model_len > capacity:
            raise ValueError(
                f"the KV cache holds {capacity} tokens of a sequence ({num_kv_blocks} blocks of "
                f"{block_size}, {self.kv_layout.num_groups} per position), "
                f"fewer than max_model_len={max_model_len}; give it more blocks or memory"
            )
        return max_model_len

    def _gpu_kv_bytes(self, net: DecoderForCausalLM, backend: AttentionBackend) -> int:
        """--gpu-memory-utilization of the GPU, less the weights and the largest step."""
        c = self.engine_config

        def step() -> None:
            largest_step(
                net, backend, Sampler(torch.Generator(self.device), self.plan.sampling),
                num_tokens=min(c.max_num_batched_tokens, self._longest()), num_rows=c.max_num_seqs,
                block_size=c.block_size, vocab_size=self.vocab_size, device=self.device,
                dtype=self.dtype,
            )  # fmt: skip

        peak = peak_step_bytes(step, self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        kv_bytes = kv_cache_bytes(total, free, c.gpu_memory_utilization, peak)
        log.info(
            "GPU memory: %.2f GiB in all, %.2f GiB in use after loading, %.2f GiB for the "
            "largest step, %.2f GiB for the KV cache",
            total / 2**30, (total - free) / 2**30, peak / 2**30, kv_bytes / 2**30,
        )  # fmt: skip
        return kv_bytes

    def _budget_blocks(self, kv_bytes: int | None, per_block: int) -> int:
        if kv_bytes is None:
            kv_bytes = min(DEFAULT_CPU_KV_CACHE_BYTES, total_memory_bytes() // 5)
        blocks = kv_bytes // per_block
        if blocks < 1:
            raise ValueError(
                f"a KV cache budget of {kv_bytes} bytes holds no block of {per_block} bytes"
            )
        return blocks

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPromptError("this model has no tokenizer; pass prompts as token ids")
            return list(self.tokenizer(prompt).input_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidPromptError("a prompt of token ids must hold only integers")
        ids = list(prompt)
        self._check_ids(ids)
        return ids

    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidPromptError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def prepare_prompt(self, prompt: str | list[int]) -> TokenizedPrompt:
        """`prompt` tokenized and its ids checked, on the caller's thread: a worker prepares
        its requests on its own threads, so that the engine's thread, which steps the model,
        never stops for a tokenizer (a 10,000-token prompt takes ~7 ms of a CPU)."""
        return TokenizedPrompt(self.tokenize(prompt), prompt if isinstance(prompt, str) else None)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that gives no sampling params runs with: the checkpoint's
        `generation_config.json` sampling (`default_sampling`), else `SamplingParams()`'s."""
        return SamplingParams(**self.default_sampling)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        stream: bool = False,
    ) -> None:
        """Queue a request. A lower `priority` is admitted first, and to admit it the engine
        preempts running requests of a higher one (as vLLM's priority scheduling). With
        `stream`, every step that gives it a token returns its output so far
        (`finished=False`) besides the final one."""
        params = params or self.get_default_sampling_params()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, TokenizedPrompt):
            token_ids, text = prompt.token_ids, prompt.text
            if token_ids and not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
                self._check_ids(token_ids)  # made by hand, not by prepare_prompt: it raises
        else:
            token_ids, text = self.tokenize(prompt), prompt if isinstance(prompt, str) else None
        if not token_ids:
            raise InvalidPromptError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens fit"
            )
        self._check_against_model(params)
        request = Request(request_id, text, token_ids, params, priority=priority, stream=stream)
        if params.prompt_logprobs is not None:
            request.prompt_entries = [None]
        seq = Sequence(request, 0, list(token_ids), len(token_ids), self._generator(params, 0))
        long_rope = self.runner.model.long_rope
        seq.rope_long = long_rope is not None and long_rope.is_long(len(token_ids))
        request.seqs.append(seq)
        request.constraint_after = self._constraint_after(params)
        self.requests[request_id] = request
        if params.structured_outputs is None:
            self.scheduler.add(seq)
        else:  # its grammar compiles off this thread; `_admit_compiled` schedules it
            self.structured_outputs.wait_for_grammar(
                request, params.structured_outputs, self.engine_config.grammar_timeout
            )

    def warm_up(self) -> None:
        """Compile what compiles (on a CPU: the decode attention, norms and rope) before the
        first request: a throwaway request's prefill and a few decode steps; and on a CPU,
        build the projections' kernels for every decode batch size whose products are cheap
        enough for a new kernel's build to show (`warm_up_products`); with Triton kernels,
        compile every variant of the attention and experts kernels a step can meet."""
        if self.device.type == "cpu":
            self.runner.model.warm_up_products(self.engine_config.max_num_seqs)
        warm_kernels = getattr(self.runner.backend, "warm_up", None)
        if warm_kernels is not None:
            started = time.perf_counter()
            model = self.runner.model
            warm_kernels(
                self.runner.kv_caches, model.num_heads, self.max_model_len, model.attention_softcap
            )
            log.info("attention kernels compiled in %.1f s", time.perf_counter() - started)
        self.runner.model.warm_up_kernels()
        if self.device.type == "cuda":
            self._record_graphs()
        request_id = "__warm_up__"
        counters = dataclasses.replace(self.scheduler.counters)
        generated, steps = self.generation_tokens, self.num_steps
        length = max(1, min(8, self.engine_config.block_size - 1))  # no full block: none cached
        prompt = [(3 + t) % self.vocab_size for t in range(length)]
        self.add_request(request_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        while request_id in self.requests:
            self.step()
        # it was nobody's work: the engine's counters (and so its metrics) leave it out
        self.scheduler.counters = counters
        self.generation_tokens, self.num_steps = generated, steps

    def _record_graphs(self) -> None:
        """CUDA graphs for decode steps unless --enforce-eager; off, with the reason logged,
        when recording fails or a replay does not match the eager step."""
        if not self.engine_config.cuda_graphs:
            self.plan = dataclasses.replace(self.plan, graphs="off (--enforce-eager)")
            log.info("CUDA graphs: off (--enforce-eager)")
            return
        started = time.perf_counter()
        reason = self.runner.record_graphs(
            self.engine_config.max_num_seqs, self.max_model_len, cuda_capture(self.device)
        )
        if reason is None:
            sizes = sorted(self.runner.graphs.replays)
            self.plan = dataclasses.replace(
                self.plan, graphs=f"decode, batch sizes up to {sizes[-1]}"
            )
            log.info(
                "CUDA graphs: recorded for decode batch sizes %s in %.1f s and checked against "
                "the eager step", sizes, time.perf_counter() - started,
            )  # fmt: skip
        else:
            self.plan = dataclasses.replace(self.plan, graphs=f"off ({reason})")
            log.warning("CUDA graphs: off, every step runs eagerly: %s", reason)

    def _check_against_model(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: token ids within this model's vocabulary,
        top-k counts within it, and `n` samples that fit in one running batch."""
        vocab = self.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise InvalidSamplingParamsError(
                    f"{name} names token id {outside[0]}, outside the model's vocabulary "
                    f"(ids 0-{vocab - 1})",
                    name,
                )
        for name in ("top_k", "logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise InvalidSamplingParamsError(
                    f"{name} must be at most the model's vocabulary size ({vocab}), got {value}",
                    name,
                )
        max_num_seqs = self.engine_config.max_num_seqs
        if params.n > max_num_seqs:
            raise InvalidSamplingParamsError(
                f"n must be at most the engine's max_num_seqs ({max_num_seqs}): a request's "
                f"samples run together, got {params.n}",
                "n",
            )

    def _constraint_after(self, params: SamplingParams) -> tuple[int, ...] | None:
        """The token ids of the text a request's constraint starts after, if it has one."""
        after = params.structured_outputs and params.structured_outputs.after
        if not after:
            return None
        if self.tokenizer is None:
            raise StructuredOutputError(
                "structured_outputs after needs the model's tokenizer, and it has none"
            )
        return tuple(self.tokenizer.encode(after, add_special_tokens=False))

    def _give_matcher(self, seq: Sequence, request: Request) -> None:
        """A fresh matcher for `seq`, kept aside until its output reaches the text the
        constraint starts after, if it has one."""
        if request.constraint_after:
            seq.deferred_matcher = self._matcher(request)
        else:
            seq.matcher = self._matcher(request)

    def _matcher(self, request: Request) -> Any:
        return None if request.grammar is None else self.structured_outputs.matcher(request.grammar)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.sample_seed(index))
        return generator

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.structured_outputs.forget(request_id)  # if it still waits for its grammar
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def running_request_ids(self) -> set[str]:
        """Ids of the requests that have a sequence in the running batch."""
        return {seq.request.request_id for seq in self.scheduler.running}

    def stats(self) -> EngineStats:
        bm, counters = self.block_manager, self.scheduler.counters
        return EngineStats(
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_blocks_cached=len(bm.cached),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prompt_tokens_computed=counters.prompt_tokens_computed,
            prompt_tokens_cached=counters.prompt_tokens_cached,
            generation_tokens=self.generation_tokens,
            num_preemptions=counters.num_preemptions,
            num_steps=self.num_steps,
            kv_blocks_saved=counters.kv_blocks_saved,
            num_deferred=counters.num_deferred,
        )

    # ---- one iteration ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of the requests that finished in it, and of the
        streamed requests that got a token in it (`finished=False`)."""
        use_device(self.device)
        if failed := self._admit_compiled():  # reported at once, in a step of their own
            return failed
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        self.num_steps += 1
        scheduled.sort(key=lambda item: item.num_new_tokens > 1)  # decodes first
        self.runner.copy_blocks(self.block_manager.take_pending_copies())
        completing = [item.seq for item in scheduled if item.completes]
        # the token masks need only tokens already chosen: fill them while the model runs
        masks = self.structured_outputs.fill_async([s.matcher for s in completing])
        self.prompt_logprobs.fill_from_cache(scheduled)
        result = self.runner.run(scheduled, self.prompt_logprobs.seqs_to_compute(scheduled))
        self.prompt_logprobs.record(scheduled, result.prompt_hidden)
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed_blocks(item.seq)
        self.prompt_logprobs.keep(scheduled, result.prompt_boundaries)
        if self.block_manager.windowed:  # after the prompt logprobs read the blocks
            for item in scheduled:
                self.block_manager.release_outside_window(item.seq)
        seqs, rows, failed = self._samples(completing)
        bitmask = None
        if masks is not None:
            bitmask, failed_masks = self._token_masks(completing, masks)
            failed += failed_masks
        if failed:  # the requests that failed take their rows with them
            kept = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            seqs, rows = [seqs[i] for i in kept], [rows[i] for i in kept]
        logits = result.sample_logits
        if rows != list(range(len(completing))):
            logits = logits[to_device(rows, logits.device)]
        if bitmask is not None:
            bitmask = bitmask[torch.tensor(rows, device=bitmask.device)]
        try:
            sampled = self._sample(seqs, logits, bitmask)
        except Exception as err:
            return failed + self._sample_apart(seqs, logits, bitmask, err)
        return failed + self._advance(seqs, sampled.token_ids, sampled.logprobs)

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, bitmask: torch.Tensor | None
    ) -> SampleResult:
        token_mask = None
        if bitmask is not None:
            token_mask = lambda rows_logits: self.structured_outputs.apply(rows_logits, bitmask)  # noqa: E731
        return self.sampler(logits, [self._sample_request(s) for s in seqs], token_mask)

    def _sample_apart(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        bitmask: torch.Tensor | None,
        err: Exception,
    ) -> list[RequestOutput]:
        """Sampling the batch raised: sample each request's rows alone, so that the error
        fails the requests it comes from and no other. An error that no request raises alone,
        or that every request raises (a plain row sampled in their stead raising too, when
        there is one), is the engine's, and is raised."""
        rows_of: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            rows_of.setdefault(seq.request.request_id, []).append(i)
        failed: list[RequestOutput] = []
        kept: list[Sequence] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for rows in rows_of.values():
            part = [seqs[i] for i in rows]
            index = to_device(rows, logits.device)
            try:
                own = self._sample(part, logits[index], None if bitmask is None else bitmask[rows])
            except Exception as own_err:
                failed.append(self._fail_request(part[0].request, own_err))
                continue
            kept += part
            tokens += own.token_ids
            logprobs += own.logprobs
        if not failed or (not kept and not self._samples_a_plain_row(logits, len(failed))):
            raise err
        return failed + self._advance(kept, tokens, logprobs)

    def _samples_a_plain_row(self, logits: torch.Tensor, num_requests: int) -> bool:
        """Whether sampling works for a request with the default settings: the control when
        every request of a step failed to sample (one request may be at fault; several cannot
        all be)."""
        if num_requests > 1:
            return False
        try:
            self.sampler(logits[:1], [SampleRequest(SamplingParams(), None, [])])
        except Exception:
            return False
        return True

    def _token_masks(
        self, completing: list[Sequence], masks: Future[torch.Tensor]
    ) -> tuple[torch.Tensor, list[RequestOutput]]:
        """The token masks of the `completing` rows. Filling them raised: the requests whose
        grammar is in error fail, and the masks of the others are filled again."""
        try:
            return self.structured_outputs.wait(masks), []
        except Exception as err:
            broken = [s for s in completing if s.matcher is not None and s.matcher.is_error()]
            if not broken:
                raise
            failed = [self._fail_request(s.request, err) for s in broken if not s.is_finished]
        matchers = [None if s.is_finished else s.matcher for s in completing]
        return self.structured_outputs.wait(self.structured_outputs.fill_async(matchers)), failed

    def _samples(
        self, completing: list[Sequence]
    ) -> tuple[list[Sequence], list[int], list[RequestOutput]]:
        """The sequences to sample a token for and their rows of the step's logits: a
        request's first completed prompt forks into its `n` samples here, sharing the prompt's
        row. Also the outputs of the requests that failed to fork."""
        rows, seqs, failed = [], [], []
        for row, seq in enumerate(completing):
            if seq.request.needs_fork:
                try:
                    children = self._fork(seq)
                except Exception as err:
                    failed.append(self._fail_request(seq.request, err))
                    continue
                for child in children:
                    rows.append(row)
                    seqs.append(child)
            rows.append(row)
            seqs.append(seq)
        return seqs, rows, failed

    def _advance(
        self, seqs: list[Sequence], tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> list[RequestOutput]:
        """Append each sequence's sampled token; the outputs of what finished or streams."""
        outputs: list[RequestOutput] = []
        failed: set[str] = set()
        streamed: dict[str, Request] = {}
        now = time.monotonic()
        long_rope = self.runner.model.long_rope
        for seq, token, top in zip(seqs, tokens, logprobs, strict=True):
            request = seq.request
            if request.request_id in failed:
                continue
            # what one request's tokens, text or output does to the engine must stay its own
            try:
                self.output_processor.append_token(seq, token, top)
                self.generation_tokens += 1
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                    if request.is_finished and request.request_id in self.requests:
                        outputs.append(self.output_processor.request_output(request))
                        del self.requests[request.request_id]
                        continue
                if long_rope is not None:
                    self._switch_to_long_rope(seq, long_rope)
                if request.stream:
                    streamed[request.request_id] = request
            except Exception as err:
                failed.add(request.request_id)
                outputs.append(self._fail_request(request, err))
        for request_id, request in streamed.items():
            if request_id in self.requests and request_id not in failed:
                try:
                    outputs.append(self.output_processor.request_output(request, finished=False))
                except Exception as err:
                    outputs.append(self._fail_request(request, err))
        return outputs

    def _switch_to_long_rope(self, seq: Sequence, long_rope: LongRope) -> None:
        """A sequence that grows past LongRoPE's original length computes its KV again, all of
        it on the long factors, as transformers' `generate` does."""
        if seq.rope_long or seq.is_finished or not long_rope.is_long(seq.num_tokens):
            return  # (a sample that ended beside its request's others needs nothing more)
        self.scheduler.recompute(seq)
        seq.rope_long = True
        seq.block_keys = []  # its keys are rooted elsewhere now

    def _fail_request(self, request: Request, err: Exception) -> RequestOutput:
        """End `request` on an error of its own: free its sequences, report what it had."""
        log.warning("request %s failed alone: %s: %s", request.request_id, type(err).__name__, err)
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
        return self.output_processor.failed_output(request, err)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        children = []
        for index in range(len(request.seqs), request.params.n):
            child = Sequence(
                request,
                index,
                list(parent.token_ids),
                parent.num_prompt_tokens,
                self._generator(request.params, index),
            )
            child.rope_long = parent.rope_long
            self._give_matcher(child, request)
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        """`seq`'s row of the sampler. Made once per sequence and kept (its token list is the
        sequence's own, which grows with it), but while min_tokens bans the stop ids."""
        params = seq.request.params
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += list(self.eos_token_ids)
            return self._new_sample_request(seq, banned)
        if seq.sample_request is None:
            seq.sample_request = self._new_sample_request(seq, [])
        return seq.sample_request

    def _new_sample_request(self, seq: Sequence, banned: list[int]) -> SampleRequest:
        params = seq.request.params
        if params.has_penalties and seq.prompt_token_set is None:
            # on the device once per sequence, not copied there at every step
            prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], device="cpu")
            seq.prompt_token_set = upload(prompt.unique(), self.device)
        return SampleRequest(
            params,
            seq.generator,
            banned,
            seq.token_ids,
            seq.num_prompt_tokens,
            seq.prompt_token_set,
        )

    # ---- requests waiting for their grammar -------------------------------------------------
    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar has compiled; fail those whose grammar did not
        compile, or not within grammar_timeout. With nothing else to run, first wait a moment
        for a compile, rather than spin."""
        idle = not self.scheduler.running and not self.scheduler.waiting
        failed = []
        for request, compiled in self.structured_outputs.settled(wait=idle):
            if self.requests.get(request.request_id) is not request:
                continue
            if isinstance(compiled, BaseException):
                failed.append(self._fail_request(request, compiled))
                continue
            request.grammar = compiled
            for seq in request.seqs:
                self._give_matcher(seq, request)
                self.scheduler.add(seq)
        return failed


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        else:
            device = "cpu"
            reason = no_cuda_reason()
            log.info("device auto: the CPU, as no CUDA GPU is visible (%s)", reason)
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is visible ({no_cuda_reason()})")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch, {torch.__version__}, is a build without CUDA"
    return f"torch {torch.__version__} finds no GPU: check the driver and the visible devices"


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (each thread has its own, device 0 at
    first): the engine is stepped from a worker's thread, and Triton launches on the current
    device."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
