"""deploy/k8s as Kubernetes would take it: each kustomization (the base, the GPU overlay) renders with
the kustomize built into kubectl, and every rendered object validates against the Kubernetes
schema (kubernetes-validate, offline, strict: unknown fields fail). Plus the properties the
deployment promises: native gRPC probes, GPUs only on GPU workers, PodDisruptionBudgets, requests."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.host_tools import run, skip_or_fail

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "gpu-overlay": K8S / "overlays" / "gpu"}
KUBERNETES_VERSION = "1.30"  # the oldest release these manifests target (native gRPC probes are GA since 1.27)


def render(name: str) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR`: kubectl ships with this machine image (kustomize v5 inside)."""
    if shutil.which("kubectl") is None:
        skip_or_fail("kubectl (with its built-in kustomize) is not installed")
    result = run(["kubectl", "kustomize", str(KUSTOMIZATIONS[name])], timeout_s=60)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    return {c["name"]: c for w in workloads for c in w["spec"]["template"]["spec"]["containers"]}


def test_every_object_validates_against_the_schema(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    assert len(objects) >= 15, f"{name}: only {len(objects)} objects rendered"
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_workloads_and_services(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    deployments, statefulsets = by_kind(objects, "Deployment"), by_kind(objects, "StatefulSet")
    assert deployments["scheduler"]["spec"]["replicas"] == 2
    assert set(deployments) == {"scheduler", "cache", "gateway"} and set(statefulsets) == {"worker", "redis"}
    services = by_kind(objects, "Service")
    assert services["worker"]["spec"]["clusterIP"] == "None", "the gateway finds workers through a headless Service"
    assert "worker:50052" in containers(objects)["gateway"]["args"]
    assert {o["metadata"]["namespace"] for o in objects} == {"hybridserve"}


def test_grpc_servers_use_native_grpc_probes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for name in ("scheduler", "cache", "worker"):
        container = containers(objects)[name]
        port = int(container["args"][container["args"].index("--port") + 1])
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": "readiness"}, name
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}, name


def test_every_container_requests_resources_and_runs_unprivileged(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for name, container in containers(objects).items():
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), f"{name} has no cpu/memory request"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    for workload in [*by_kind(objects, "Deployment").values(), *by_kind(objects, "StatefulSet").values()]:
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_disruption_budgets_cover_every_serving_tier(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == {"scheduler", "cache", "worker", "gateway"}
    for name, budget in budgets.items():
        assert budget["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}


def test_only_gpu_workers_take_gpus() -> None:
    base, gpu = containers(render("base")), containers(render("gpu-overlay"))
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in base.values())
    assert gpu["worker"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["worker"]["image"].endswith(":cuda") and base["worker"]["image"].endswith(":cpu")
    assert [n for n, c in gpu.items() if "nvidia.com/gpu" in c["resources"].get("limits", {})] == ["worker"]
    assert gpu["worker"]["args"] == base["worker"]["args"]


def test_secrets_are_referenced_never_embedded(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    assert not by_kind(objects, "Secret"), "a Secret with a value in the repository"
    env = containers(objects)["cache"]["env"]
    password = next(e for e in env if e["name"] == "HYBRIDSERVE_CACHE_REDIS_PASSWORD")
    assert password["valueFrom"]["secretKeyRef"] == {"name": "hybridserve-redis", "key": "password"}
    worker_env = {e["name"]: e for e in containers(objects)["worker"]["env"]}
    for container_env in (env, list(worker_env.values())):
        token = next(e for e in container_env if e["name"] == "HYBRIDSERVE_CLUSTER_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hybridserve-cluster", "key": "token"}
    key = worker_env["HYBRIDSERVE_WORKER_CHECKPOINT_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "hybridserve-cluster", "key": "checkpoint-key"}


def test_the_model_comes_from_one_config_map_and_an_init_container_downloads_it() -> None:
    for name in KUSTOMIZATIONS:
        objects = render(name)
        assert by_kind(objects, "ConfigMap")["hybridserve-model"]["data"] == {"MODEL": "", "MODEL_REVISION": ""}
        worker = by_kind(objects, "StatefulSet")["worker"]["spec"]["template"]["spec"]
        (download,) = worker["initContainers"]
        assert "hybridserve download" in download["args"][0]
        assert {"name": "models", "mountPath": "/models"} in download["volumeMounts"]
        assert {e["name"] for e in download["env"]} >= {"HF_HUB_CACHE", "HF_TOKEN"}
        assert next(e for e in download["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]["optional"]
        env = {e["name"]: e for e in containers(objects)["worker"]["env"]}
        assert env["HYBRIDSERVE_WORKER_MODEL"]["valueFrom"]["configMapKeyRef"]["key"] == "MODEL"
        assert env["HF_HUB_OFFLINE"]["value"] == "1" and env["HF_HUB_CACHE"]["value"] == "/models/hub"
        gateway = containers(objects)["gateway"]  # no model: the workers send its files (GetModelFiles)
        assert not gateway.get("env") and not gateway.get("volumeMounts") and "--model" not in gateway["args"]


def test_gpu_workers_size_their_pools_from_the_device() -> None:
    base, gpu = containers(render("base")), containers(render("gpu-overlay"))
    base_env = {e["name"]: e.get("value") for e in base["worker"]["env"]}
    gpu_env = {e["name"]: e.get("value") for e in gpu["worker"]["env"]}
    assert base_env["HYBRIDSERVE_WORKER_MEMORY_BUDGET_BYTES"] == str(4 << 30)
    assert gpu_env["HYBRIDSERVE_WORKER_MEMORY_BUDGET_BYTES"] == "0"  # 0: from --gpu-memory-utilization
    assert gpu_env["HYBRIDSERVE_WORKER_GPU_MEMORY_UTILIZATION"] == "0.9"
    assert "--memory-budget-mb" not in base["worker"]["args"]
