"""The benchmarks' model: a random-weight Llama (~56M parameters by default) written by
transformers, its shape and matmul FLOPs, the command-line options that size it and the engine
around it, and transformers' own static-batch `generate` as the baseline."""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from machine import allocator, loadavg
from report import rule

from conveyor.demo_model import write_tiny_model

# ---------------------------------------------------------------------------------------------
# options

# the shape of the benchmark Llama (~56M parameters), as `write_tiny_model` takes it
BENCH_LLAMA = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
)


def add_model_arguments(ap: argparse.ArgumentParser, max_positions: int) -> None:
    """The shape of the ~56M-parameter benchmark Llama (see `model_overrides`)."""
    ap.add_argument("--hidden-size", type=int, default=BENCH_LLAMA["hidden_size"])
    ap.add_argument("--intermediate-size", type=int, default=BENCH_LLAMA["intermediate_size"])
    ap.add_argument("--num-layers", type=int, default=BENCH_LLAMA["num_hidden_layers"])
    ap.add_argument("--num-heads", type=int, default=BENCH_LLAMA["num_attention_heads"])
    ap.add_argument("--num-kv-heads", type=int, default=BENCH_LLAMA["num_key_value_heads"])
    ap.add_argument("--vocab-size", type=int, default=BENCH_LLAMA["vocab_size"])
    ap.add_argument("--max-position-embeddings", type=int, default=max_positions)
    ap.add_argument(
        "--attention-backend",
        default="compiled",
        help="our engine's attention: compiled (decode compiled by torch.compile, the fastest "
        "on a CPU; its one compile happens in the warm-up) or torch (eager)",
    )


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """Threads, where the checkpoint goes, and the engine's batch and block sizes."""
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every run (default: torch's default, the core count)",
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="write (or reuse) the checkpoint here instead of a temp dir",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)


def rounds_parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments of a bench that times the engine on rounds of new requests to the random
    model (transformers not loaded): the model's and the run's, --requests (128), --rounds,
    --seed and --quick (32 requests, one round: `parse_rounds` applies it)."""
    ap = argparse.ArgumentParser(description=description)
    add_model_arguments(ap, max_positions=1024)
    add_run_arguments(ap)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="32 requests, one round")
    ap.set_defaults(skip_hf=True)
    return ap


def parse_rounds(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 32, 1
    return args


def model_overrides(args: argparse.Namespace) -> dict:
    return dict(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
    )


# ---------------------------------------------------------------------------------------------
# the model


@dataclass
class ModelShape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            cfg.vocab_size,
        )

    def linears(self) -> list[tuple[str, int, int, int]]:
        """(name, in_features, out_features, count per model) of every decode matmul."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = self.layers
        return [
            ("q_proj", h, q, n),
            ("k_proj", h, kv, n),
            ("v_proj", h, kv, n),
            ("o_proj", q, h, n),
            ("gate_proj", h, self.inter, n),
            ("up_proj", h, self.inter, n),
            ("down_proj", self.inter, h, n),
            ("lm_head", h, self.vocab, 1),
        ]

    def matmul_flops_per_token(self) -> int:
        return sum(2 * i * o * c for _, i, o, c in self.linears())

    def attention_flops_per_token(self, context: float) -> float:
        # q.k and p.v for every head over `context` cached positions
        return 4.0 * self.layers * self.heads * self.head_dim * context

    def parameters(self) -> int:
        """The parameter count without loading the model: the matmuls' weights, the
        embedding and the norms."""
        return (
            self.matmul_flops_per_token() // 2
            + self.vocab * self.hidden
            + self.layers * 2 * self.hidden
            + self.hidden
        )


def prepare_model(args: argparse.Namespace) -> tuple[tempfile.TemporaryDirectory | None, Path]:
    """The checkpoint directory (a temp dir unless --model-dir), written if not there yet."""
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="conveyor-bench-")
        model_dir = Path(tmp.name) / "llama"
    else:
        model_dir = args.model_dir
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        write_tiny_model(
            model_dir, "llama", with_tokenizer=False, seed=args.seed, **model_overrides(args)
        )
        print(f"wrote random-weight llama to {model_dir} in {time.perf_counter() - t:.1f}s")
    return tmp, model_dir


def print_setup(threads: int, extra: str = "") -> None:
    """The lines every benchmark starts with: machine load, allocator, versions, threads."""
    load = loadavg()
    if load is not None:
        print(f"load average at start: {load:.2f} (1 min)")
    print(f"allocator: {allocator()}")
    print(
        f"python {platform.python_version()}  torch {torch.__version__}  "
        f"cpu {platform.processor() or platform.machine()}  cores {os.cpu_count()}  "
        f"torch threads {threads}{extra}"
    )


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Save next to the checkpoint a byte-level BPE tokenizer of `vocab_size` tokens, trained
    on this machine's Python sources (deterministic for a given set of installed packages),
    for benchmarks that need real token strings (grammars, detokenization)."""
    import sysconfig

    from conveyor.demo_model import build_tokenizer

    sources = sorted(Path(sysconfig.get_paths()["purelib"]).glob("*/*.py"))[:3000]
    texts = (p.read_text(errors="replace") for p in sources)
    build_tokenizer(vocab_size, texts).save_pretrained(str(model_dir))


def engine_with_tokenizer(m: BenchModel, args: argparse.Namespace, max_num_seqs: int) -> Any:
    """Our engine on the checkpoint, with `write_tokenizer`'s tokenizer beside it, prefix
    caching off."""
    from conveyor.engine import LLM

    write_tokenizer(m.path, m.shape.vocab)
    return LLM(str(m.path), device="cpu", enable_prefix_caching=False,
               attention_backend=args.attention_backend, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size)  # fmt: skip


@dataclass
class BenchModel:
    """The checkpoint a run measures, its shape, and transformers' copy of it (unless
    --skip-hf)."""

    path: Path
    shape: ModelShape
    hf: Any | None
    params: int
    threads: int
    tmp: tempfile.TemporaryDirectory | None

    def cleanup(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def set_up(args: argparse.Namespace, setup_extra: str = "") -> BenchModel:
    """Threads and seed as asked, the setup lines, and the model written and loaded."""
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(args.seed)

    rule("setup")
    print_setup(threads, setup_extra)
    tmp, model_dir = prepare_model(args)

    from transformers import AutoConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(str(model_dir)))
    hf = None if args.skip_hf else load_hf(model_dir)
    params = sum(p.numel() for p in hf.parameters()) if hf is not None else shape.parameters()
    return BenchModel(model_dir, shape, hf, params, threads, tmp)


# ---------------------------------------------------------------------------------------------
# transformers baseline


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # generate exactly max_new_tokens: no EOS at all, rather than suppressing it with
    # min_new_tokens (which would change greedy picks compared with ignore_eos on our side)
    model.generation_config.eos_token_id = None
    return model


def hf_generate_batch(model, prompts: list[list[int]], max_new: int, pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    gen = out[:, width:]
    assert gen.shape[1] == max_new, f"transformers generated {gen.shape[1]} of {max_new} tokens"
    return gen, width
