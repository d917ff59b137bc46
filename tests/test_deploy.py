"""The deployment files: Kubernetes manifests against the Kubernetes schemas
(``kubernetes-validate``, offline), the Dockerfiles through ``hadolint``, the systemd units
through ``systemd-analyze verify``; and the flags, ports and probe services they name
against the daemon's own."""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from weightcache.core.rpc import LIVENESS, READINESS
from weightcache_service.budget import parse_size
from weightcache_service.cli import _parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBE = DEPLOY / "kubernetes"
MANIFESTS = sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile*"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
#: The oldest Kubernetes the manifests support (grpc probes are GA since 1.27), and the
#: newest whose schemas the installed kubernetes-validate bundles.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _daemonsets() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in _documents(p) if d["kind"] == "DaemonSet"]


def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifests_match_the_kubernetes_schemas(manifest: Path, version: str) -> None:
    for document in _documents(manifest):
        kubernetes_validate.validate(document, version, strict=True)


def test_validation_catches_a_misspelt_field() -> None:
    [daemonset] = _documents(KUBE / "daemonset.yaml")
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}

    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)


def test_kustomization_lists_the_manifests() -> None:
    [kustomization] = _documents(KUBE / "kustomization.yaml")

    assert kustomization["kind"] == "Kustomization"
    assert kustomization["resources"] == ["namespace.yaml", "daemonset.yaml", "service.yaml"]
    assert all((KUBE / name).is_file() for name in kustomization["resources"])


@pytest.mark.parametrize("daemonset", _daemonsets(), ids=lambda d: d["metadata"]["name"])
def test_daemonset_probes_ports_and_memory_match_the_daemon(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]
    [container] = pod["spec"]["containers"]
    args = container["args"]
    parsed = _parser().parse_args(args)  # every flag is one the daemon takes
    health_port = int(parsed.health_listen.rpartition(":")[2])
    metrics_port = int(parsed.metrics_listen.rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    assert parsed.command == "preload"
    assert ports == {"grpc-health": health_port, "metrics": metrics_port}
    probes = {
        kind: (container[kind]["grpc"]["port"], container[kind]["grpc"]["service"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {
        "startupProbe": (health_port, LIVENESS),
        "livenessProbe": (health_port, LIVENESS),
        "readinessProbe": (health_port, READINESS),
    }
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # More than the drain: holders get REVOKING and the drain timeout at SIGTERM.
    assert pod["spec"]["terminationGracePeriodSeconds"] > parsed.drain_timeout
    env = {e["name"]: e["value"] for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["sockets"] == env["WEIGHTCACHE_RUNTIME_DIR"] == "/run/weightcache"
    assert volumes["sockets"]["hostPath"]["path"] == "/run/weightcache"
    assert (mounts["shm"], volumes["shm"]["hostPath"]["path"]) == ("/dev/shm", "/dev/shm")
    if parsed.device == "cpu":  # the arenas are this container's tmpfs pages
        limit = _quantity(container["resources"]["limits"]["memory"])
        budget, _ = parse_size(parsed.max_memory)
        assert budget is not None
        assert limit >= budget + 2**30
        assert (
            container["resources"]["requests"]["memory"]
            == container["resources"]["limits"]["memory"]
        )


def _quantity(text: str) -> int:
    """A Kubernetes memory quantity with a binary suffix (``10Gi``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(text[:-2]) * units[text[-2:]]


def test_worker_pod_reaches_the_daemons_socket_and_segments() -> None:
    [daemonset] = _documents(KUBE / "daemonset.yaml")
    [worker] = _documents(KUBE / "worker-pod.yaml")
    daemon_pod = daemonset["spec"]["template"]["spec"]
    [container] = worker["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v.get("hostPath", {}) for v in worker["spec"]["volumes"]}
    # A node without a daemon must not keep the worker from starting (it falls back).
    assert volumes["weightcache-sockets"]["type"] == "DirectoryOrCreate"
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert env["WEIGHTCACHE_LABEL"] == "$(POD_NAMESPACE)/$(POD_NAME)"
    assert fields == {"POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    host_paths = {
        v["name"]: v["hostPath"]["path"] for v in worker["spec"]["volumes"] if "hostPath" in v
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}

    assert env["WEIGHTCACHE_TRUSTED_UID"] == str(daemon_pod["securityContext"]["runAsUser"])
    assert env["WEIGHTCACHE_RUNTIME_DIR"] == "/run/weightcache"
    assert worker["spec"]["securityContext"]["supplementalGroups"] == [
        daemon_pod["securityContext"]["runAsGroup"]
    ]
    assert (host_paths["weightcache-sockets"], mounts["weightcache-sockets"]) == (
        "/run/weightcache",
        "/run/weightcache",
    )
    assert (host_paths["shm"], mounts["shm"]) == ("/dev/shm", "/dev/shm")


def test_a_gpu_worker_shares_the_daemons_gpu_by_time_slicing() -> None:
    """The GPU daemon takes one ``nvidia.com/gpu``; time-slicing (the NVIDIA device
    plugin's config, version v1) makes each GPU several, of which the GPU worker takes
    one on the same nodes, in the host's IPC namespace as the daemon (CUDA IPC)."""
    [daemonset] = _documents(KUBE / "daemonset-cuda.yaml")
    [worker] = _documents(KUBE / "worker-pod-cuda.yaml")
    [config_map] = _documents(KUBE / "gpu-time-slicing.yaml")
    daemon_pod = daemonset["spec"]["template"]["spec"]
    [daemon] = daemon_pod["containers"]
    [container] = worker["spec"]["containers"]
    [plugin_config] = config_map["data"].values()
    sharing = yaml.safe_load(plugin_config)
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v.get("hostPath", {}) for v in worker["spec"]["volumes"]}

    assert sharing["version"] == "v1"
    [replicated] = sharing["sharing"]["timeSlicing"]["resources"]
    assert (replicated["name"], replicated["replicas"]) == ("nvidia.com/gpu", 8)
    assert sharing["sharing"]["timeSlicing"]["renameByDefault"] is False
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert daemon_pod["hostIPC"] is worker["spec"]["hostIPC"] is True
    assert worker["spec"]["nodeSelector"] == daemon_pod["nodeSelector"]
    assert "--device=cuda:0" in daemon["args"]
    assert 'device="cuda:0"' in container["args"][0]
    assert env["WEIGHTCACHE_RUNTIME_DIR"] == "/run/weightcache"
    assert env["WEIGHTCACHE_TRUSTED_UID"] == str(daemon_pod["securityContext"]["runAsUser"])
    assert volumes["weightcache-sockets"] == {
        "path": "/run/weightcache",
        "type": "DirectoryOrCreate",
    }


def _hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    return str(found) if found.exists() else (shutil.which("hadolint") or "hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    text = dockerfile.read_text()
    assert "USER 10001:10001" in text  # not root
    assert 'VOLUME ["/run/weightcache"' in text
    assert 'ENTRYPOINT ["weightcache"]' in text


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")

    result = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, check=False
    )

    assert result.returncode == 1
    assert "DL3007" in result.stdout  # :latest
    assert "DL3013" in result.stdout  # unpinned pip


def _in_context(rel: str) -> bool:
    """Whether ``.dockerignore`` lets the repository path ``rel`` into the build context
    (Docker's rules: the last pattern that matches the path or a folder above it wins)."""
    lines = (DEPLOY.parent / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.removeprefix("!").rstrip("/")
        names = [glob, glob.removeprefix("**/")] if glob.startswith("**/") else [glob]
        matched = any(
            fnmatch.fnmatchcase(p, name) or fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], name)
            if name != glob
            else fnmatch.fnmatchcase(p, name)
            for p in prefixes
            for name in names
        )
        if matched:
            included = negated
    return included


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_build_has_the_protos_the_wheel_links_to(dockerfile: Path) -> None:
    """``weightcache.proto_path()`` works in the image: the wheel follows
    ``client/weightcache/protos``'s symlinks, whose targets (``protos/...``) must be in
    the build context and copied where the links point, beside ``client/``."""
    root = DEPLOY.parent
    links = sorted((root / "client" / "weightcache" / "protos").iterdir())
    targets = [str(link.resolve().relative_to(root)) for link in links]
    build_stage = dockerfile.read_text().split("\nFROM ")[1]  # the first FROM: the build
    copied = dict(re.findall(r"^COPY (\S+) (\S+)$", build_stage, re.MULTILINE))

    assert all(link.is_symlink() for link in links)
    assert targets == ["protos/google", "protos/weightcache"]
    assert copied["client"] == "./client"
    assert copied["protos"] == "./protos"  # the same place relative to client/
    proto = "protos/weightcache/v1/weight_cache_service.proto"
    assert [_in_context(p) for p in (proto, "protos/google/rpc/status.proto")] == [True, True]
    assert [_in_context(p) for p in ("client/weightcache/core/hub.py", "tests/support.py")] == [
        True,
        False,
    ]
    assert not _in_context("client/weightcache/__pycache__/x.pyc")


def test_images_build_when_a_container_engine_is_there() -> None:
    """Building pulls a base image and torch: only where asked (``WEIGHTCACHE_DOCKER_BUILD=1``)
    and a Docker engine answers."""
    docker = shutil.which("docker")
    if os.environ.get("WEIGHTCACHE_DOCKER_BUILD") != "1" or docker is None:
        pytest.skip("set WEIGHTCACHE_DOCKER_BUILD=1 with a Docker engine to build the images")
    if subprocess.run([docker, "info"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no Docker engine answers")
    root = DEPLOY.parent
    for dockerfile in DOCKERFILES:
        subprocess.run(
            [docker, "build", "-f", str(dockerfile), "-t", f"weightcache-test:{dockerfile.name}"],
            cwd=root,
            check=True,
            timeout=3600,
        )


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_verify(unit: Path, tmp_path: Path) -> None:
    """``systemd-analyze verify`` finds nothing to say: the unit's command points at the
    installed console script here (``/usr/local/bin/weightcache`` need not exist)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    script = Path(sys.executable).with_name("weightcache")
    copy_ = tmp_path / unit.name
    copy_.write_text(unit.read_text().replace("/usr/local/bin/weightcache", str(script)))
    name = unit.name.replace("@.", "@0.")  # a template is verified through an instance

    result = subprocess.run(
        [analyze, "verify", "--man=no", f"./{name}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
