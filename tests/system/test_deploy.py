"""deploy/: Kubernetes manifests valid against the API schemas (offline) and in agreement with serving/."""

from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.policy import model as gateway_policy
from serving import profile as profiles
from serving.launcher import build_commands

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30.0"


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def gpu_commands() -> dict[str, list[str]]:
    """The engine arguments serving/gpu.yaml gives each deployment, as deployed (all interfaces)."""
    commands = build_commands(profiles.load("gpu"), host="0.0.0.0", python="python3")
    return {name: cmd.argv for name, cmd in commands.items()}


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    present = sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present


def test_pair_pod_runs_the_gpu_profile_commands_on_one_gpu() -> None:
    pod = find("Deployment", "vllm-pair")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    script_lines = [shlex.split(line.rstrip(" &")) for line in container["args"][0].splitlines()]
    started = [
        line for line in script_lines if line[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    ]
    assert started == [gpu_commands()["hq"], gpu_commands()["fast"]]  # HQ first: it takes its memory first
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    gpu = profiles.load("gpu").deployments
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"hq": gpu.hq.port, "fast": gpu.fast.port}


@pytest.mark.parametrize("name", ["hq", "fast"])
def test_services_expose_profile_ports(name: str) -> None:
    service = find("Service", f"vllm-{name}")
    (port,) = service["spec"]["ports"]
    assert port["port"] == getattr(profiles.load("gpu").deployments, name).port
    assert port["targetPort"] == name


def test_gpu_memory_split_matches_profile() -> None:
    commands = gpu_commands()
    shares = {
        name: float(argv[argv.index("--gpu-memory-utilization") + 1]) for name, argv in commands.items()
    }
    gpu = profiles.load("gpu").deployments
    assert shares == {"hq": gpu.hq.share, "fast": gpu.fast.share}
    assert sum(shares.values()) < 0.95


def test_policy_configmap_points_at_the_pair() -> None:
    text = find("ConfigMap", "gateway-policy")["data"]["policy.yaml"]
    assert text == (DEPLOY / "policy" / "policy.yaml").read_text()
    policy = gateway_policy.parse(text, "gateway-policy")
    gpu = profiles.load("gpu").deployments
    for name, dep in gpu.items():
        assert policy.deployments[name].url == f"http://vllm-{name}:{dep.port}"
        assert policy.deployments[name].served_model == dep.served_model
        assert policy.deployments[name].max_model_len == dep.max_model_len


def test_gateway_replicas_read_the_policy_configmap_as_a_directory() -> None:
    deployment = find("Deployment", "agent-gateway")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "policy"]
    # A subPath mount would never see ConfigMap updates, so hot reload needs the directory mount.
    assert "subPath" not in mount
    assert env["AGENT_GATEWAY_POLICY"] == mount["mountPath"] + "/policy.yaml"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "policy"]
    assert volume["configMap"]["name"] == "gateway-policy"
    assert env["AGENT_GATEWAY_REDIS_URL"].startswith("redis://redis:")
    service = find("Service", "agent-gateway")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_compose_runs_the_same_pair() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    for name, argv in gpu_commands().items():
        service = services[f"vllm-{name}"]
        assert service["entrypoint"] + service["command"] == argv
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ["0"]  # both on the same GPU
    assert services["vllm-fast"]["depends_on"]["vllm-hq"]["condition"] == "service_healthy"
    gateway = services["gateway"]
    assert gateway["environment"]["AGENT_GATEWAY_POLICY"] == "/etc/agent-gateway/policy.yaml"
    assert "./policy:/etc/agent-gateway:ro" in gateway["volumes"]
    gateway_policy.load(DEPLOY / "policy" / "policy.yaml")


def test_prometheus_scrapes_gateway_and_both_deployments() -> None:
    compose_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    k8s_config = yaml.safe_load(find("ConfigMap", "prometheus")["data"]["prometheus.yml"])
    gpu = profiles.load("gpu").deployments
    for config in (compose_config, k8s_config):
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        assert "agent-gateway" in jobs
        targets = {t for group in jobs["vllm"]["static_configs"] for t in group["targets"]}
        assert targets == {f"vllm-hq:{gpu.hq.port}", f"vllm-fast:{gpu.fast.port}"}


def test_otel_collector_config_is_shared() -> None:
    text = find("ConfigMap", "otel-collector")["data"]["config.yaml"]
    assert text == (DEPLOY / "otel-collector.yaml").read_text()
    config = yaml.safe_load(text)
    assert set(config["service"]["pipelines"]["traces"]["receivers"]) == {"otlp"}


def _mounts(deployment: str) -> dict[str, str]:
    """{ConfigMap name: mount path} of a Deployment's only container."""
    pod = find("Deployment", deployment)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    return {volumes[m["name"]]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in volumes}


def test_prometheus_loads_the_alert_rules() -> None:
    rules = DEPLOY / "prometheus" / "alerts.yml"
    assert find("ConfigMap", "prometheus-rules")["data"]["alerts.yml"] == rules.read_text()
    mounts = _mounts("prometheus")
    (container,) = find("Deployment", "prometheus")["spec"]["template"]["spec"]["containers"]
    assert f"--config.file={mounts['prometheus']}/prometheus.yml" in container["args"]
    k8s_config = yaml.safe_load(find("ConfigMap", "prometheus")["data"]["prometheus.yml"])
    loaded = PurePosixPath(mounts["prometheus-rules"]) / "alerts.yml"
    assert any(fnmatch.fnmatch(str(loaded), pattern) for pattern in k8s_config["rule_files"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in compose["volumes"]
    compose_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert compose_config["rule_files"] == ["/etc/prometheus/alerts.yml"]  # ./prometheus/alerts.yml, mounted


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard() -> None:
    grafana = DEPLOY / "grafana"
    files = {
        "grafana-datasources": ("prometheus.yaml", grafana / "provisioning" / "datasources" / "prometheus.yaml"),
        "grafana-dashboard-providers": ("agent-gateway.yaml",
                                        grafana / "provisioning" / "dashboards" / "agent-gateway.yaml"),
        "grafana-dashboards": ("agent-gateway.json", grafana / "agent-gateway.json"),
    }
    for config_map, (key, path) in files.items():
        assert find("ConfigMap", config_map)["data"][key] == path.read_text(), f"{config_map} differs from {path}"
    mounts = _mounts("grafana")
    assert mounts["grafana-datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["grafana-dashboard-providers"] == "/etc/grafana/provisioning/dashboards"
    (provider,) = yaml.safe_load(files["grafana-dashboard-providers"][1].read_text())["providers"]
    assert provider["options"]["path"] == mounts["grafana-dashboards"]
    (source,) = yaml.safe_load(files["grafana-datasources"][1].read_text())["datasources"]
    (port,) = find("Service", "prometheus")["spec"]["ports"]
    assert source["url"] == f"http://prometheus:{port['port']}"
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in compose["volumes"]
    assert f"./grafana/agent-gateway.json:{provider['options']['path']}/agent-gateway.json:ro" in compose["volumes"]


def test_the_image_builds_the_c_extensions_and_refuses_to_ship_without_them() -> None:
    """No docker engine runs the tests: the Dockerfile is read. A build stage with a compiler builds the wheel,
    its extensions required; the runtime stage installs that wheel and checks every extension imports."""
    text = (DEPLOY / "Dockerfile").read_text()
    _, build, runtime = text.split("\nFROM ")
    assert build.startswith("python:3.11-slim AS build") and "gcc" in build
    assert "AGENT_GATEWAY_NATIVE=required pip wheel" in build
    assert "COPY --from=build /wheels /wheels" in runtime and "pip install --no-cache-dir /wheels/*.whl" in runtime
    assert "gcc" not in runtime and "native.loaded()" in runtime
    assert 'os.environ.get("AGENT_GATEWAY_NATIVE", "optional") != "required"' in (
        DEPLOY.parent / "setup.py").read_text()
