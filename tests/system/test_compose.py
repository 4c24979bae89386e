"""docker-compose.yml (and the CPU variant): its service graph, and every service's command run
natively in compose order, this machine's PostgreSQL and Redis standing in for the containers,
then the nightly pipeline example against that stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from graphlib import TopologicalSorter
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from conveyor.cli import build_parser
from conveyor.cli.common import EXIT_TOO_MANY_FAILED
from conveyor.env_args import env_name, option_actions
from conveyor.settings import Settings
from conveyor.testing import Stack, create_key, free_port
from deploy.api_requirements import ENGINE_PACKAGES, api_requirements
from docs.hooks import generated as docs_pages

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"
ENV_EXAMPLE = ROOT / ".env.example"
NIGHTLY = ROOT / "examples" / "nightly"
SOURCE_DIRS = ["conveyor", "api", "ledger", "worker", "engine", "kernels", "migrations"]
DEPENDENCY_CONDITIONS = {"service_healthy", "service_completed_successfully"}
STAND_INS = {"postgres": "postgres", "redis": "redis"}  # service -> image it must run


# ---- reading compose files --------------------------------------------------------------------


class Reset:
    """Compose's `!reset` tag: the override removes the value."""


class ComposeLoader(yaml.SafeLoader):
    pass


def _override(loader: ComposeLoader, node: yaml.Node) -> object:
    """Compose's `!override` tag: the value replaces the base's instead of merging."""
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return loader.construct_scalar(node)  # type: ignore[arg-type]


class Override:
    def __init__(self, value: object) -> None:
        self.value = value


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", _override)


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def merge(base: object, override: object) -> object:
    """Compose's merge of an override file: mappings merge key by key, anything else is
    replaced, `!reset` removes."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            elif isinstance(value, Override):
                out[key] = value.value
            else:
                out[key] = merge(base.get(key), value) if key in base else value
        return out
    return override


def variants() -> dict[str, dict]:
    gpu = load(COMPOSE)
    return {"gpu": gpu, "cpu": merge(gpu, load(CPU_OVERRIDE))}  # type: ignore[dict-item]


_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":-", "-"):
            return arg if unset else current  # type: ignore[return-value]
        if op in (":?", "?") and unset:
            raise KeyError(f"{name}: {arg}")
        return current or ""

    return _VAR.sub(sub, value)


def variables(value: object) -> set[str]:
    """The names a compose value interpolates."""
    names: set[str] = set()
    if isinstance(value, dict):
        for v in value.values():
            names |= variables(v)
    elif isinstance(value, list):
        for v in value:
            names |= variables(v)
    elif isinstance(value, str):
        for m in _VAR.finditer(value):
            if m.group(0) != "$$":
                names.add(m.group(1) or m.group(4))
    return names


def required_variables(text: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_]\w*):?\?", text))


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def commented_env_names(path: Path) -> set[str]:
    return set(re.findall(r"^#\s*([A-Z][A-Z0-9_]+)=", path.read_text(), re.M))


def dockerfile_targets() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M))


def dockerfile_stage(name: str) -> str:
    text = (ROOT / "Dockerfile").read_text()
    start = re.search(rf"^FROM\s+\S+\s+AS\s+{name}$", text, re.M)
    assert start, name
    end = re.search(r"^FROM\s", text[start.end() :], re.M)
    return text[start.start() : start.end() + end.start() if end else len(text)]


def test_the_gpu_image_can_build_triton_and_runs_the_tested_torch() -> None:
    """What Triton needs when it first launches (a C compiler and libc's headers; it never
    calls `cc`), the torch the tests run (a CUDA build), and a worker that asks for CUDA."""
    text = (ROOT / "Dockerfile").read_text()
    stage = dockerfile_stage("worker")
    installs = " ".join(re.findall(r"apt-get install ([^&]+)", stage))
    assert {"gcc", "libc6-dev"} <= set(installs.split()), installs
    tested = re.search(r"pip install (?:--\S+ )*torch==(\S+)", (ROOT / ".ci" / "run").read_text())
    assert tested and re.search(rf"^ARG TORCH_VERSION={re.escape(tested[1])}$", text, re.M)
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX}"' in stage
    assert re.search(r"^ARG TORCH_CUDA_INDEX=https://download\.pytorch\.org/whl/cu\d+$", text, re.M)
    assert "TRITON_CACHE_DIR=/models/triton" in stage
    command = 'CMD ["conveyor", "worker", "--device", "cuda"]'
    assert re.findall(r"^CMD .*$", stage, re.M) == [command]
    assert "-runtime" not in text  # PyTorch's runtime images have no compiler


def code_env_reads() -> set[str]:
    """Environment variables our code reads by name: its settings' and those read directly."""
    pattern = re.compile(
        r"(?:os\.environ\.get\(|os\.getenv\(|os\.environ\[)\s*\"([A-Z_][A-Z0-9_]*)\""
    )
    names = {Settings.variable(name) for name in Settings.model_fields}
    for d in SOURCE_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            names |= set(pattern.findall(path.read_text()))
    return names


def worker_option_env() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {env_name(a) for a in option_actions(sub.choices["worker"])}


def documented_settings() -> dict[str, str]:
    """`| \\`NAME\\` | default | meaning |` rows of the documentation's pages (docs/
    configuration.md, and the pages that explain a group of them): name -> default."""
    text = "\n".join(
        docs_pages.on_page_markdown(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))
    )
    rows = re.findall(r"^\| `([A-Z_][A-Z0-9_<>]*)` \| ([^|]+) \|", text, re.M)
    return {name: default.strip() for name, default in rows}


# ---- the graph --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_compose_service_graph(variant: str) -> None:
    compose = interpolate(variants()[variant], env_file(ENV_EXAMPLE))
    assert isinstance(compose, dict)
    services: dict[str, dict] = compose["services"]
    targets = dockerfile_targets()
    built_images = {s["image"] for s in services.values() if "build" in s and "image" in s}
    declared_volumes = set(compose.get("volumes") or {})
    assert {"postgres", "redis", "migrate", "api", "worker", "flower"} <= set(services)

    for name, svc in services.items():
        # an image we build (with a Dockerfile target that exists), or a pinned public image
        if "build" in svc:
            build = svc["build"]
            assert (ROOT / build["context"]).is_dir(), name
            assert build["target"] in targets, f"{name}: no Dockerfile target {build['target']}"
        else:
            image = svc["image"]
            assert image in built_images or re.fullmatch(r"[\w./-]+:[\w.-]+", image), name
            assert not image.endswith(":latest") or image in built_images, name
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            condition = spec["condition"]
            assert condition in DEPENDENCY_CONDITIONS, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
            else:  # a one-shot job, run to completion before its dependents start
                assert services[dep].get("restart") == "no", dep
        for mount in svc.get("volumes") or []:
            source = mount.split(":")[0]
            assert source in declared_volumes, f"{name}: {source} is not a named volume"

    # the ledger and broker the services use are the compose services, never an embedded file
    for name in ("migrate", "api", "worker"):
        env = services[name]["environment"]
        assert urlsplit(env["DATABASE_URL"]).hostname == "postgres", name
        assert urlsplit(env["REDIS_URL"]).hostname == "redis", name
    assert services["migrate"]["command"] == ["conveyor", "migrate"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("api", "worker"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
    assert "conveyor ready" in " ".join(services["api"]["healthcheck"]["test"])
    assert "--appendonly" in services["redis"]["command"]  # Redis keeps its queue on disk
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["flower"]["profiles"] == ["monitoring"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    for config in services["prometheus"]["configs"]:  # config files exist beside the compose file
        assert (ROOT / compose["configs"][config["source"]]["file"]).is_file()
    assert services["worker"]["env_file"] == ".env"
    assert services["api"]["environment"]["CONVEYOR_AUTH"] == "required"

    devices = (
        services["worker"].get("deploy", {}).get("resources", {}).get("reservations", {})
    ).get("devices")
    if variant == "gpu":
        assert services["worker"]["build"]["target"] == "worker"
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        # replicas share the GPUs and each claims its own through the lock volume
        assert services["worker"]["environment"]["CONVEYOR_GPU_LOCK_DIR"] == "/locks"
        # a GPU worker that sees no GPU refuses to start instead of running on the CPU
        assert services["worker"]["command"][-2:] == ["--device", "cuda"]
        # compiled kernels live in a volume
        cache = services["worker"]["environment"]["TRITON_CACHE_DIR"]
        mounts = [m.split(":")[1] for m in services["worker"]["volumes"]]
        assert any(cache.startswith(m + "/") for m in mounts), (cache, mounts)
    else:
        assert services["worker"]["build"]["target"] == "worker-cpu"
        assert devices is None
        assert "--device" in services["worker"]["command"]


def test_settings_are_documented_and_set() -> None:
    text = COMPOSE.read_text()
    example = env_file(ENV_EXAMPLE)
    documented = documented_settings()
    worker_env = worker_option_env()

    # no secrets in the compose file: the one password is required from .env
    assert "POSTGRES_PASSWORD" in required_variables(text)
    assert not re.search(r"PASSWORD:\s*[\w-]+\s*$", text, re.M)
    # every variable compose needs from .env is in the example, and nothing there is unused
    compose_vars = variables(load(COMPOSE)) | variables(load(CPU_OVERRIDE))
    assert required_variables(text) <= set(example)
    for name in set(example) | commented_env_names(ENV_EXAMPLE):
        assert name in compose_vars or name in worker_env or name in documented, name
    # every variable the code reads has a documented default (docs/)
    for name in code_env_reads():
        assert name in documented, f"{name} is read by the code but not documented in docs/"
    assert "CONVEYOR_<OPTION>" in documented  # the rule for `conveyor worker` options
    assert {"CONVEYOR_MODEL", "CONVEYOR_MAX_NUM_SEQS", "CONVEYOR_DEVICE"} <= worker_env
    # and compose sets what has no usable default inside a container
    services = load(COMPOSE)["services"]
    assert "CONVEYOR_MODEL" in services["worker"]["environment"]
    assert services["api"]["environment"]["CONVEYOR_DATA_DIR"] == "/data"


# ---- running it -------------------------------------------------------------------------------


def _argv(command: list[str]) -> list[str]:
    """A container's `conveyor ...` command, as this machine runs the same entry point."""
    assert command[0] == "conveyor", command
    return [sys.executable, "-m", "conveyor", *command[1:]]


def _healthcheck_argv(test: list[str]) -> list[str]:
    assert test[0] == "CMD", test
    return _argv(test[1:])


@pytest.fixture
def native_stack(tmp_path: Path) -> Iterator[Stack]:
    """The services' processes; each runs with the environment compose would give it."""
    stack = Stack(env=dict(os.environ), root=tmp_path)
    try:
        yield stack
    finally:
        stack.stop(grace=20)


def test_compose_runs_natively_then_the_nightly_example(
    native_stack: Stack,
    database_url: str,
    redis_url: str,
    chat_model: Path,
    tmp_path: Path,
) -> None:
    compose = variants()["cpu"]
    services: dict[str, dict] = compose["services"]
    port, metrics_port = free_port(), free_port()
    # what docker compose would read from .env: the example, filled in
    dotenv = env_file(ENV_EXAMPLE) | {
        "POSTGRES_PASSWORD": "unused-here",
        "MODEL": str(chat_model),
        "SERVED_MODEL_NAME": "tiny",
        "CONVEYOR_PORT": str(port),
        "CONVEYOR_RECONCILE_INTERVAL": "1",
        "CONVEYOR_HEARTBEAT_INTERVAL": "0.5",
    }
    volumes = {name: tmp_path / "volumes" / name for name in compose["volumes"]}

    active = {n: s for n, s in services.items() if not s.get("profiles")}
    order = list(
        TopologicalSorter(
            {n: set(s.get("depends_on") or {}) for n, s in active.items()}
        ).static_order()
    )
    assert order.index("migrate") < order.index("api") and order.index("migrate") < order.index(
        "worker"
    )
    api_url = f"http://127.0.0.1:{port}"
    for name in order:
        svc = interpolate(active[name], dotenv)
        assert isinstance(svc, dict)
        if name in STAND_INS:  # this machine's server stands in for the container
            assert svc["image"].split(":")[0] == STAND_INS[name]
            continue
        env = dict(os.environ)
        if "env_file" in svc:
            env |= dotenv
        env |= {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        for mount in svc.get("volumes") or []:  # a named volume becomes a directory here
            volume, target = mount.split(":")[:2]
            here = volumes[volume]
            here.mkdir(parents=True, exist_ok=True)
            for key, value in env.items():
                if value == target or value.startswith(target + "/"):
                    env[key] = str(here) + value[len(target) :]
        # the compose hosts `postgres` and `redis` are this machine's servers
        env |= {"DATABASE_URL": database_url, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
        if "CONVEYOR_METRICS_PORT" in env:  # a container's own port; a free one here
            env["CONVEYOR_METRICS_PORT"] = str(metrics_port)
        argv = _argv(svc["command"])
        if svc.get("restart") == "no":  # one-shot: must complete before its dependents
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
            if name == "migrate":  # what the README has the operator do next: make a key
                api_key = create_key(env, "nightly").secret
            continue
        proc = native_stack.start(name, argv, env)
        if "healthcheck" in svc:
            probe = _healthcheck_argv(svc["healthcheck"]["test"])
            deadline = time.time() + 90
            while subprocess.run(probe, env=env, capture_output=True).returncode != 0:
                assert proc.poll() is None, f"{name} exited:\n{native_stack.log(name)}"
                assert time.time() < deadline, f"{name} never healthy:\n{native_stack.log(name)}"
                time.sleep(0.5)

    # the API wants a key (CONVEYOR_AUTH=required); the worker is up when the API lists its model
    assert httpx.get(f"{api_url}/v1/models").status_code == 401
    auth = {"Authorization": f"Bearer {api_key}"}
    deadline = time.time() + 120
    while "tiny" not in [
        m["id"] for m in httpx.get(f"{api_url}/v1/models", headers=auth).json()["data"]
    ]:
        assert native_stack.named["worker"].poll() is None, native_stack.log("worker")
        assert time.time() < deadline, native_stack.log("worker")
        time.sleep(0.5)

    run_env = dict(os.environ) | {
        "START_STACK": "0",
        "CONVEYOR_URL": api_url,
        "CONVEYOR_API_KEY": api_key,
        "SERVED_MODEL": "tiny",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    eval_lines = [json.loads(x) for x in (NIGHTLY / "eval.jsonl").read_text().splitlines()]
    assert "docker compose" in (NIGHTLY / "nightly.sh").read_text()  # what START_STACK=0 skips

    def night(stamp: str, out: Path, **env: str) -> subprocess.CompletedProcess:
        """One run of the nightly step, writing under `out`."""
        return subprocess.run(
            ["bash", str(NIGHTLY / "nightly.sh")],
            env=run_env | {"STAMP": stamp, "OUT_DIR": str(out), **env},
            capture_output=True,
            text=True,
            timeout=300,
        )

    out = tmp_path / "night-1"
    good = night("2026-01-01", out)
    assert good.returncode == 0, good.stderr
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in eval_lines)
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    assert (out / "errors.jsonl").read_text() == ""

    # one bad line and --max-failed 0: the documented failure code, the line in the errors file
    bad_file = tmp_path / "eval-bad.jsonl"
    bad = dict(eval_lines[0], custom_id="bad-1")
    bad["body"] = dict(bad["body"], temperature=-1)
    bad_file.write_text("".join(json.dumps(x) + "\n" for x in [*eval_lines, bad]))
    out = tmp_path / "night-2"
    failed = night("2026-01-02", out, EVAL_FILE=str(bad_file))
    assert failed.returncode == EXIT_TOO_MANY_FAILED, failed.stderr
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad-1"]
    assert len((out / "results.jsonl").read_text().splitlines()) == len(eval_lines)
    # the unchanged lines came from the first night's results
    assert f"completed ({len(eval_lines)} reused)" in failed.stderr, failed.stderr

    # the third night, one task edited: only it is computed, and the summary says so
    edited_file = tmp_path / "eval-edited.jsonl"
    edited = [dict(x) for x in eval_lines]
    edited[0]["body"] = dict(edited[0]["body"], max_tokens=31)
    edited_file.write_text("".join(json.dumps(x) + "\n" for x in edited))
    out = tmp_path / "night-3"
    third = night("2026-01-03", out, EVAL_FILE=str(edited_file))
    assert third.returncode == 0, third.stderr
    assert f"{len(eval_lines)} completed ({len(eval_lines) - 1} reused)" in third.stderr
    results = {json.loads(x)["custom_id"]: json.loads(x) for x in
               (out / "results.jsonl").read_text().splitlines()}  # fmt: skip
    assert "reused_from" not in results[edited[0]["custom_id"]]
    assert all("reused_from" in r for c, r in results.items() if c != edited[0]["custom_id"])

    # the worker's metrics, where deploy/prometheus.yml scrapes them
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    generated = re.search(r"^conveyor:generation_tokens_total\{[^}]*\} (\S+)$", scraped, re.M)
    assert generated and float(generated.group(1)) > 0, scraped
    assert "port: 9400" in (ROOT / "deploy" / "prometheus.yml").read_text()
    assert services["worker"]["environment"]["CONVEYOR_METRICS_PORT"] == 9400


BLOCK_ENGINE_PACKAGES = """
import sys
blocked = {blocked!r}

class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{{name}} is not installed in the API image")

sys.meta_path.insert(0, NotInTheImage())
"""


def test_the_api_image_needs_no_engine_packages(tmp_path: Path) -> None:
    """The API image installs deploy/api_requirements.py's list: no torch, no transformers.
    Its commands (migrate, serve, ready) must run with those packages absent."""
    listed = api_requirements(ROOT / "pyproject.toml")
    assert not any(r.split(">")[0].split("[")[0] in ENGINE_PACKAGES for r in listed)
    assert any(r.startswith("fastapi") for r in listed)

    blocked = sorted(p.replace("-", "_") for p in ENGINE_PACKAGES)
    prelude = BLOCK_ENGINE_PACKAGES.format(blocked=blocked)
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    run = [sys.executable, "-c", prelude + "from conveyor.cli import main; sys.exit(main())"]
    migrated = subprocess.run([*run, "migrate", "--database-url", db], capture_output=True)
    assert migrated.returncode == 0, migrated.stderr.decode()
    ready = subprocess.run([*run, "ready", "--url", "http://127.0.0.1:9"], capture_output=True)
    assert ready.returncode == 1 and b"not ready" in ready.stderr, ready.stderr.decode()
    app = prelude + (
        "from conveyor.api.app import create_app\n"
        "from conveyor.settings import Settings\n"
        f"create_app(Settings(data_dir=__import__('pathlib').Path({str(tmp_path)!r}), "
        f"database_url={db!r}, redis_url='redis://127.0.0.1:1/0'))\n"
        "assert 'torch' not in sys.modules\n"
    )
    built = subprocess.run([sys.executable, "-c", app], capture_output=True)
    assert built.returncode == 0, built.stderr.decode()
