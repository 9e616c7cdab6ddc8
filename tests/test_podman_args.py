"""The podman arguments the image tests run the agent's container with (tests/podspec.py),
derived from the injector's output: what each field becomes, that every field is read
(changing any changes the arguments or is refused), and that a field the derivation does not
know fails. No podman here."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from agent.deploy.inject import STATE_DIR, STATE_VOLUME, TOKEN_DIR, TOKEN_VOLUME, Options
from tests.podspec import IGNORED, Pod, UnknownField, injected, materialize, run_args

FIXTURES = Path(__file__).parent / "fixtures" / "kube-ovn"
OPTIONS = Options(image="localhost/natgw-agent:test", api_host="127.0.0.1", api_port="16443")
HOST_DIRS = {TOKEN_VOLUME: Path("/tmp/token"), STATE_VOLUME: Path("/tmp/state")}
NETWORK = "ns:/run/netns/ngw123456-gw"


def gateway_pod(name: str = "statefulset-pod.yaml") -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / name).read_text())


def derive(container: dict[str, Any], volumes: dict[str, Any], doc: dict[str, Any] | None = None) -> Any:
    return run_args(container, volumes, Pod.of(doc or gateway_pod()), HOST_DIRS, NETWORK, "t1")


def pairs(args: tuple[str, ...], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def test_each_field_of_the_injected_container_becomes_its_podman_argument() -> None:
    doc = gateway_pod()
    container, volumes = injected(doc, OPTIONS)
    run = derive(container, volumes, doc)
    args = run.args
    assert json.loads(pairs(args, "--entrypoint")[0]) == container["command"]
    assert args[-1] == OPTIONS.image  # no args: the command alone, the image's CMD dropped
    assert pairs(args, "--env") == ["GATEWAY_NAME=gw1", "POD_NAMESPACE=kube-system", f"NATGW_TOKEN_DIR={TOKEN_DIR}",
                                    "KUBERNETES_SERVICE_HOST=127.0.0.1", "KUBERNETES_SERVICE_PORT=16443"]
    assert pairs(args, "--cap-drop") == ["ALL"] and pairs(args, "--cap-add") == ["NET_ADMIN"]
    assert pairs(args, "--security-opt") == ["no-new-privileges"] and pairs(args, "--user") == ["0"]
    assert pairs(args, "--memory") == [str(256 << 20)] and pairs(args, "--cpu-shares") == ["20"]
    assert pairs(args, "--volume") == [f"/tmp/token:{TOKEN_DIR}:ro", f"/tmp/state:{STATE_DIR}"]
    assert pairs(args, "--network") == [NETWORK] and pairs(args, "--pull") == ["missing"]
    assert pairs(args, "--name") == ["natgw-agent-vpc-nat-gw-gw1-0-t1"]
    assert run.probes["readiness"].command == tuple(container["readinessProbe"]["exec"]["command"])
    assert run.probes["liveness"].command == ("natgw-agent", "health", "--live", "--state-dir", STATE_DIR)
    assert run.probes["liveness"].timeout == 2


def test_a_pod_routed_by_readiness_is_ready_once_its_data_plane_was_programmed() -> None:
    doc = gateway_pod("deployment-pod.yaml")
    probes = derive(*injected(doc, OPTIONS), doc).probes
    assert set(probes) == {"readiness", "liveness"} and "--routable" in probes["readiness"].command


def leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path, value


def changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if value[:1].isdigit():  # a quantity: twice as much
        number = "".join(c for c in value if c.isdigit())
        return str(int(number) * 2) + value[len(number):]
    return value + "x"


def spec_path(path: tuple[Any, ...]) -> str:
    key = ".".join(str(p) for p in path if not isinstance(p, int))
    return "probe." + key.split(".", 1)[1] if key.endswith("Threshold") and "Probe" in key else key


CONTAINER, VOLUMES = injected(gateway_pod(), OPTIONS)


@pytest.mark.parametrize("path", [p for p, _ in leaves(CONTAINER)], ids=lambda p: ".".join(map(str, p)))
def test_every_field_is_read(path: tuple[Any, ...]) -> None:
    """Changing any field of the container changes the run, or is refused as unknown: no
    field is silently left out. Fields the kubelet gives no effect are listed in IGNORED."""
    if spec_path(path) in IGNORED:
        return
    container = copy.deepcopy(CONTAINER)
    *parents, last = path
    holder = container
    for key in parents:
        holder = holder[key]
    holder[last] = changed(holder[last])
    before = derive(CONTAINER, VOLUMES)
    try:
        after = derive(container, VOLUMES)
    except UnknownField:
        return
    assert after != before, f"{'.'.join(map(str, path))} changed but the run did not"


def test_ignored_fields_are_in_the_spec() -> None:
    """IGNORED lists fields the injector sets, not guesses."""
    paths = {spec_path(p) for p, _ in leaves(CONTAINER)}
    assert "resources.requests.memory" in paths
    assert all(p in paths or p.startswith("probe.") for p in IGNORED)


@pytest.mark.parametrize("extra", [
    {"stdin": True},
    {"ports": [{"containerPort": 10299}]},
    {"securityContext": {"privileged": True}},
    {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
    {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
    {"resources": {"limits": {"ephemeral-storage": "1Gi"}}},
    {"livenessProbe": {"httpGet": {"path": "/livez", "port": 10299}}},
    {"volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": "/x", "subPath": "token"}]},
], ids=lambda e: json.dumps(e)[:40])
def test_a_field_the_derivation_does_not_know_fails(extra: dict[str, Any]) -> None:
    with pytest.raises(UnknownField):
        derive({**CONTAINER, **extra}, VOLUMES)


def test_a_volume_of_another_kind_fails() -> None:
    volumes = {**VOLUMES, STATE_VOLUME: {"name": STATE_VOLUME, "hostPath": {"path": "/run"}}}
    with pytest.raises(UnknownField):
        derive(CONTAINER, volumes)


def test_the_token_volume_is_laid_out_as_the_kubelet_projects_it(tmp_path: Path) -> None:
    materialize(VOLUMES[TOKEN_VOLUME], Pod.of(gateway_pod()), tmp_path, "TOKEN",
                {"kube-root-ca.crt": {"ca.crt": "PEM"}})
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "token": "TOKEN", "ca.crt": "PEM", "namespace": "kube-system"}
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o444}
