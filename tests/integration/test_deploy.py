"""The deploy files parse, hold what they must (AOF, GPU reservations, shared volumes,
restarts), and name only worker flags and settings that exist.

Where a real validator is on the machine it runs too: ``docker compose config`` and
``systemd-analyze verify``; Kubernetes built-in kinds are checked against their JSON
schemas (kubernetes-validate). Without docker or systemd the structural checks still
run, and a warning says which tool was missing.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import redis
import tomllib
import typer
import yaml

from layertap.producer.cli.app import app
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "layertap-worker@.service"


def worker_flags() -> set[str]:
    command = typer.main.get_command(app).commands["worker"]  # type: ignore[attr-defined]
    return {option for param in command.params for option in (*param.opts, *param.secondary_opts)}


def flags(argv: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def check_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``LAYERTAP_*`` name is a setting, and Settings reads the given value back."""
    for name, raw in env.items():
        if not name.startswith("LAYERTAP_"):
            continue
        path = name.removeprefix("LAYERTAP_").lower().split("__")
        model: Any = Settings
        for part in path:
            assert part in model.model_fields, f"{name} is not a layertap setting"
            model = model.model_fields[part].annotation
        with monkeypatch.context() as patch:
            patch.setenv(name, raw)
            value: Any = Settings().model_dump(mode="json")
        for part in path:
            value = value[part]
        assert str(value) == raw, f"{name}={raw!r} is read as {value!r}"


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# -- compose ------------------------------------------------------------------------------
def test_compose_file(monkeypatch, tmp_path):
    compose = load_yaml(ROOT / "compose.yaml")[0]
    services = compose["services"]
    redis = services["redis"]
    command = redis["command"]
    assert value_after(command, "--appendonly") == "yes" and value_after(command, "--appendfsync") == "always"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    named_volumes = set(compose["volumes"])

    workers = {name: service for name, service in services.items() if name.startswith("worker-")}
    assert len(workers) >= 2
    device_ids, nodes = [], []
    for name, service in workers.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        device_ids += device["device_ids"]
        assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert flags(service["command"]) <= worker_flags(), name
        nodes.append(value_after(service["command"], "--node-name"))
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        env = service["environment"]
        check_settings(env, monkeypatch)
        assert interpolate(env["LAYERTAP_REDIS_URL"], {"REDIS_PASSWORD": "pw"}) == "redis://:pw@redis:6379/0"
        mounts = dict(volume.split(":")[::-1] for volume in service["volumes"])
        assert mounts[env["LAYERTAP_STORAGE_ROOT"]] in named_volumes  # outputs on a shared named volume
        assert {"outputs", "hf-cache"} <= {volume.split(":")[0] for volume in service["volumes"]}
    assert len(set(device_ids)) == len(device_ids) and len(set(nodes)) == len(nodes)

    flower_url = services["flower"]["environment"]["CELERY_BROKER_URL"]
    assert interpolate(flower_url, {"REDIS_PASSWORD": "pw"}) == "redis://:pw@redis:6379/0"
    with pytest.raises(KeyError, match="run deploy/make-redis-secret first"):
        interpolate(flower_url, {})
    config_mount = next(v for v in services["prometheus"]["volumes"] if v.endswith("prometheus.yml:ro"))
    prometheus = load_yaml(ROOT / config_mount.split(":")[0])[0]
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    port = next(iter(workers.values()))["environment"]["LAYERTAP_WORKER__METRICS_PORT"]
    assert {f"{name}:{port}" for name in workers} <= targets
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in named_volumes or (ROOT / source).exists(), volume

    validate_with_compose(tmp_path)


def validate_with_compose(tmp_path: Path) -> None:
    """``docker compose config`` where Compose v2 is installed; else Compose v1
    (``docker-compose``, Debian's package), given the file less its top-level ``name``,
    a key v1 predates; else only the structural checks above."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command, compose_file = ["docker", "compose"], ROOT / "compose.yaml"
    elif shutil.which("docker-compose"):
        v1_text, removed = re.subn(r"^name: \S+\n", "", (ROOT / "compose.yaml").read_text(), flags=re.M)
        assert removed == 1
        compose_file = tmp_path / "compose-v1.yaml"
        compose_file.write_text(v1_text)
        command = ["docker-compose"]
    else:
        warnings.warn("no `docker compose` here: compose.yaml was checked by structure only", stacklevel=1)
        return
    out = subprocess.run([*command, "-f", str(compose_file), "--project-directory", str(ROOT), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}`` / ``${NAME:?message}`` interpolation (KeyError with the message when unset)."""
    def value(match: re.Match[str]) -> str:
        name, message = match.group(1), match.group(2)
        if not env.get(name):
            raise KeyError(message or name)
        return env[name]
    return re.sub(r"\$\{(\w+)(?::\?([^}]*))?\}", value, text)


def generated_password(root: Path) -> str:
    """Run the documented step (``deploy/make-redis-secret``) into ``root``; the password it wrote."""
    (root / "deploy" / "k8s").mkdir(parents=True)
    subprocess.run([str(DEPLOY / "make-redis-secret"), str(root)], check=True, capture_output=True, timeout=30)
    password = env_file(root / ".env")["REDIS_PASSWORD"]
    assert re.fullmatch(r"[0-9a-f]{64}", password)
    assert (root / "deploy" / "k8s" / "redis-password").read_text() == password
    assert (root / ".env").stat().st_mode & 0o077 == 0  # readable by its owner alone
    subprocess.run([str(DEPLOY / "make-redis-secret"), str(root)], check=True, capture_output=True, timeout=30)
    assert env_file(root / ".env")["REDIS_PASSWORD"] == password  # run again: kept, not replaced
    return password


def check_redis_refuses_strangers(redis_args: list[str], client_urls: list[str], tmp_path: Path) -> None:
    """A real Redis started with the shipped ``--requirepass`` refuses a client without the password
    and accepts each shipped client URL (its host pointed at that server)."""
    password = value_after(redis_args, "--requirepass")
    with RedisServer(data_dir=tmp_path, extra_args=["--requirepass", password]) as server:
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, password="guess").ping()
        for url in client_urls:
            local = re.sub(r"@[^/]+/", f"@127.0.0.1:{server.port}/", url)
            assert redis.Redis.from_url(local).ping()


def test_compose_redis_has_a_generated_password_and_refuses_clients_without_it(tmp_path):
    password = generated_password(tmp_path / "repo")
    services = load_yaml(ROOT / "compose.yaml")[0]["services"]
    env = {"REDIS_PASSWORD": password}
    redis_args = [interpolate(arg, env) for arg in services["redis"]["command"]]
    assert interpolate(services["redis"]["environment"]["REDISCLI_AUTH"], env) == password  # the health check's
    urls = [interpolate(service["environment"]["LAYERTAP_REDIS_URL"], env)
            for name, service in services.items() if name.startswith("worker-")]
    urls.append(interpolate(services["flower"]["environment"]["CELERY_BROKER_URL"], env))
    check_redis_refuses_strangers(redis_args, urls, tmp_path / "redis")


def test_kubernetes_redis_has_a_generated_secret_and_refuses_clients_without_it(tmp_path):
    password = generated_password(tmp_path / "repo")
    kustomization = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")[0]
    (generator,) = kustomization["secretGenerator"]
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True
    secret = {key: (tmp_path / "repo" / "deploy" / "k8s" / file).read_text()
              for key, file in (entry.split("=", 1) for entry in generator["files"])}
    resources = k8s_resources()

    def container_env(container: dict[str, Any]) -> dict[str, str]:
        """The container's env as Kubernetes resolves it: secret keys read, ``$(NAME)`` expanded in order."""
        resolved: dict[str, str] = {}
        for item in container["env"]:
            if "valueFrom" in item and "secretKeyRef" in item["valueFrom"]:
                ref = item["valueFrom"]["secretKeyRef"]
                assert ref["name"] == generator["name"]
                resolved[item["name"]] = secret[ref["key"]]
            elif "value" in item:
                resolved[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m.group(1), m.group(0)),
                                                item["value"])
        return resolved

    (redis_container,) = resources[("Deployment", "layertap-redis")]["spec"]["template"]["spec"]["containers"]
    redis_env = container_env(redis_container)
    assert redis_env["REDISCLI_AUTH"] == password  # the probes' redis-cli
    redis_args = [re.sub(r"\$\((\w+)\)", lambda m: redis_env[m.group(1)], arg) for arg in redis_container["args"]]
    (worker,) = resources[("Deployment", "layertap-worker")]["spec"]["template"]["spec"]["containers"]
    check_redis_refuses_strangers(redis_args, [container_env(worker)["LAYERTAP_REDIS_URL"]], tmp_path / "redis")

    (trigger,) = resources[("ScaledObject", "layertap-worker")]["spec"]["triggers"]
    auth = resources[("TriggerAuthentication", trigger["authenticationRef"]["name"])]["spec"]["secretTargetRef"]
    assert auth == [{"parameter": "password", "name": generator["name"], "key": "password"}]


# -- Dockerfile ---------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_builds_a_non_root_cuda_worker_image():
    instructions = dockerfile_instructions()
    args = dict(value.split("=", 1) for kind, value in instructions if kind == "ARG")
    base = next(value for kind, value in instructions if kind == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], base)
    assert base.startswith("pytorch/pytorch:") and "cuda" in base
    users = [value for kind, value in instructions if kind == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("RUN", 'pip install ".[worker,s3]"') in instructions
    assert json.loads(next(value for kind, value in instructions if kind == "ENTRYPOINT")) == ["layertap", "worker"]
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for kind, value in instructions:
        if kind == "COPY":
            for source in value.split()[:-1]:
                assert (ROOT / source).exists() and source.rstrip("/") not in ignored, source
    worker_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    assert any(dep.startswith("prometheus-client") for dep in worker_extra)


# -- Kubernetes ---------------------------------------------------------------------------
def k8s_resources() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")[0]
    files = sorted(path.name for path in (DEPLOY / "k8s").glob("*.yaml") if path.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files
    resources = {}
    for name in files:
        for doc in load_yaml(DEPLOY / "k8s" / name):
            resources[(doc["kind"], doc["metadata"]["name"])] = doc
    return resources


def test_kubernetes_manifests(monkeypatch):
    resources = k8s_resources()
    version = kubernetes_validate.latest_version()
    for doc in resources.values():
        if not doc["apiVersion"].startswith("keda.sh/"):
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error

    namespace = resources[("Namespace", "layertap")]["metadata"]["name"]
    redis_pod = resources[("Deployment", "layertap-redis")]["spec"]["template"]["spec"]
    (redis,) = redis_pod["containers"]
    assert value_after(redis["args"], "--appendonly") == "yes"
    assert value_after(redis["args"], "--appendfsync") == "always"
    assert value_after(redis["args"], "--maxmemory-policy") == "noeviction"  # refuses writes at the limit, never evicts
    claim = redis_pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in resources
    assert redis["volumeMounts"][0]["mountPath"] == value_after(redis["args"], "--dir")
    service = resources[("Service", "layertap-redis")]
    assert service["spec"]["selector"].items() <= resources[("Deployment", "layertap-redis")]["spec"]["template"][
        "metadata"]["labels"].items()
    redis_address = f"layertap-redis.{namespace}.svc:{service['spec']['ports'][0]['port']}"

    deployment = resources[("Deployment", "layertap-worker")]
    pod = deployment["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert flags(worker["args"]) <= worker_flags()
    config = resources[("ConfigMap", worker["envFrom"][0]["configMapRef"]["name"])]["data"]
    check_settings({**config, **{e["name"]: e["value"] for e in worker["env"] if "value" in e}}, monkeypatch)
    worker_env = {e["name"]: e["value"] for e in worker["env"] if "value" in e}
    assert "LAYERTAP_REDIS_URL" not in config  # it holds the password: built from the Secret
    assert worker_env["LAYERTAP_REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{redis_address}/0"
    mounts = {mount["mountPath"]: mount["name"] for mount in worker["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    outputs = volumes[mounts[config["LAYERTAP_STORAGE_ROOT"]]]["persistentVolumeClaim"]["claimName"]
    assert resources[("PersistentVolumeClaim", outputs)]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert worker["ports"][0]["containerPort"] == int(config["LAYERTAP_WORKER__METRICS_PORT"])

    scaled = resources[("ScaledObject", "layertap-worker")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == keys.model_queue(config["LAYERTAP_WORKER__SERVED_MODEL_NAME"])
    assert trigger["metadata"]["address"] == redis_address
    assert int(trigger["metadata"]["listLength"]) > 0


# -- systemd ------------------------------------------------------------------------------
def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as ordered ``(key, value)`` lists (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert current is not None and sep, f"not a unit file line: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def env_file(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_systemd_unit(monkeypatch, tmp_path):
    unit = parse_unit(UNIT.read_text())
    service = unit["Service"]
    one = {key: value for key, value in service}
    assert one["Restart"] == "on-failure" and one["User"] not in ("root", "0")
    assert unit["Install"] == [("WantedBy", "multi-user.target")]
    argv = shlex.split(one["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/layertap") and argv[1] == "worker"
    assert flags(argv) <= worker_flags()
    example = env_file(DEPLOY / "systemd" / "worker.env.example")
    model_var = re.fullmatch(r"\$\{(\w+)\}", value_after(argv, "--model")).group(1)
    assert model_var in example
    assert one["EnvironmentFile"] == "/etc/layertap/worker.env"

    instance = dict(value.split("=", 1) for key, value in service if key == "Environment")
    assert instance["CUDA_VISIBLE_DEVICES"] == "%i" and "%i" in instance["LAYERTAP_WORKER__NODE_NAME"]
    assert not set(instance) & set(example)  # the environment file would win over the per-instance values
    host = socket.gethostname()
    check_settings({name: value.replace("%i", "0").replace("%H", host) for name, value in instance.items()},
                   monkeypatch)
    check_settings(example, monkeypatch)

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        warnings.warn("no systemd-analyze here: the unit was checked by parsing only", stacklevel=1)
        return
    layertap = Path(sys.executable).with_name("layertap")
    assert layertap.is_file()
    instance_file = tmp_path / "layertap-worker@0.service"
    instance_file.write_text(UNIT.read_text().replace(argv[0], str(layertap)))
    out = subprocess.run([analyze, "verify", str(instance_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "layertap-worker" not in out.stdout + out.stderr  # no warning about our unit
