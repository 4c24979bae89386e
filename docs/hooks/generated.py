"""MkDocs hook: the pages' generated parts, from the code and the benchmarks' records, so
nothing is written twice. A page asks for one with a line of its own:

    {{ engine_options }}          every engine flag, its CONVEYOR_<OPTION> form and its help
    {{ settings GROUP }}          the service's settings of GROUP (`conveyor.settings.setting`)
    {{ architectures }}           the checkpoint architectures the engine runs, and how
    {{ bench_runs NAME }}         the runs recorded in bench/results/NAME.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS_SHOWN = 12  # the latest runs of a record; the file holds them all
# the columns shown per record, after its date and code: what each benchmark is for
BENCH_COLUMNS = {
    "engine_ceiling": ["dtype", "cpu_isa", "share_of_ceiling", "vs_transformers",
                       "engine_tokens_per_s"],
    "engine_vs_hf": ["threads", "ours_tok_s", "hf_tok_s", "ratio"],
    "eval_scoring": ["requests", "cached_share", "speedup_vs_off", "logprobs_equal"],
    "gpu_check": ["device", "model", "check", "ok", "seconds"],
    "grammar_engines": ["llguidance", "xgrammar"],
    "moe_vs_hf": ["dtype", "checkpoint_dtype", "cpu_isa", "experts_run", "ours_tok_s",
                  "hf_tok_s", "hf_batch_size", "ratio"],
    "online_churn": ["cpu_isa", "model", "online_rate_limit", "urgent_share", "drops", "refused",
                     "ratio_vs_quiet", "engine_alone_ratio", "abort_latency_ms_p50"],
    "prefix_sharing": ["num_requests", "cached_fraction", "ratio_vs_off", "ratio_vs_hf"],
    "pipeline": ["num_requests", "create_s", "processing_s", "e2e_req_s", "copy_rows_s"],
    "sampling_features": ["plain_tokens_per_s", "penalties_cost", "structured_cost"],
    "sampled_decoding": ["cpu_isa", "dtype", "time_over_greedy"],
    "step_profile": ["cpu_isa", "dtype", "attention", "elementwise", "sequences", "decode_ms",
                     "prefill_ms"],
    "reuse": ["lines", "first_s", "rerun_s", "rerun_share_of_first", "edited_reused",
              "other_weights_reused", "lookup_sqlite_s", "lookup_postgresql_s"],
    "stop_strings": ["cpu_isa", "ratios", "end_to_end", "host_ms_per_step_256"],
    "batch_invariant": ["cpu_isa", "dtype", "ratio", "ratios", "identical_alone"],
    "worker_memory": ["cpu_isa", "requests_per_batch", "worker_mb_at_start",
                      "worker_mb_after_each", "growth_mb_per_batch_second_half",
                      "level_after_batch", "level_mb"],
    "triton_decode_sweep": ["device", "DECODE_BLOCK_N", "DECODE_NUM_WARPS",
                            "DECODE_NUM_STAGES", "share_of_copy"],
}  # fmt: skip
MARKER = re.compile(
    r"^\{\{ (engine_options|bench_runs|settings|architectures) ?([a-z_]*) \}\}$", re.M
)


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(lambda m: _render(m.group(1), m.group(2)), markdown)


def _render(kind: str, arg: str) -> str:
    if kind == "settings":
        return settings_table(arg)
    if kind == "architectures":
        return architectures()
    return engine_options() if kind == "engine_options" else bench_runs(arg)


def settings_table(group: str) -> str:
    """The settings of `group`, each with its variable, default and meaning, as declared."""
    from conveyor.settings import Settings

    rows = ["| setting (environment) | default | meaning |", "|---|---|---|"]
    for name, f in Settings.model_fields.items():
        meta = f.json_schema_extra
        if meta["group"] != group:
            continue
        default = f.get_default(call_default_factory=True)
        shown = meta["shown"] or ("unset" if default is None else f"{default:g}")
        rows.append(f"| `{Settings.variable(name)}` | {shown} | {_cell(f.description)} |")
    if len(rows) == 2:
        raise ValueError(f"no settings in group {group!r}")
    return "\n".join(rows)


def architectures() -> str:
    """The engine's model registry: each architecture a checkpoint may name, its class, and
    what the class runs."""
    import inspect

    from conveyor.engine.models import MODEL_REGISTRY

    rows = ["| `architectures` in config.json | runs as | what it runs |", "|---|---|---|"]
    for arch, cls in sorted(MODEL_REGISTRY.items()):
        doc = " ".join((inspect.getdoc(cls) or "").split())
        rows.append(f"| `{arch}` | `{cls.__name__}` | {_cell(doc)} |")
    return "\n".join(rows)


def engine_options() -> str:
    """The table of `conveyor worker`'s engine flags, from the parser `--help` prints."""
    from conveyor.cli.engine_options import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    rows = ["| flag | environment (`conveyor worker`, `serve`) | meaning |", "|---|---|---|"]
    for action in parser._action_groups[-1]._group_actions:
        flag = action.option_strings[0]
        env = "CONVEYOR_" + action.dest.upper()
        rows.append(f"| `{flag}` | `{env}` | {_cell(action.help or '')} |")
    return "\n".join(rows)


def bench_runs(name: str) -> str:
    path = ROOT / "bench" / "results" / f"{name}.jsonl"
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    columns = ["date", "code", *BENCH_COLUMNS[name]]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs[-RUNS_SHOWN:]:
        rows.append("| " + " | ".join(_cell(_value(run.get(c))) for c in columns) + " |")
    shown = min(len(runs), RUNS_SHOWN)
    return (
        "\n".join(rows)
        + f"\n\nThe latest {shown} of {len(runs)} runs in `bench/results/{name}.jsonl`."
    )


def _value(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
