"""The agent's container as `podman run` arguments, derived from the injector's output
(agent/deploy/inject.py) as the kubelet would run that spec, so that the image tests
(netns-tests/test_image.py) start exactly what a gateway pod starts and the two cannot drift
apart. Pure: no podman, no I/O but writing a projected volume's files.

Every field of the container spec is read: it becomes podman arguments (command, env,
securityContext, resources, volumeMounts), or a Probe the test drives itself, or it is in
IGNORED with the reason the kubelet gives it no effect in a running container. A field this
module does not know raises UnknownField: a new field in the injector fails the unit tests
(tests/test_podman_args.py) until it is mapped here."""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonpatch

from agent.deploy.inject import Options, patch

# Fields that change nothing in a running container, and why.
IGNORED = {
    "resources.requests.memory": "scheduling only: on cgroup v1 the kubelet writes no cgroup value from a memory "
                                 "request (memory.min only with the MemoryQoS feature, on cgroup v2)",
    "probe.successThreshold": "must be 1 for liveness; the test asks each probe once",
}


class UnknownField(ValueError):
    """A field of the container spec (or of a volume) this derivation does not map."""

    def __init__(self, path: str, value: Any = None) -> None:
        super().__init__(f"{path}: not mapped to podman arguments (value {value!r}); map it in tests/podspec.py")
        self.path = path


@dataclass(frozen=True)
class Pod:
    """What the kubelet knows of the pod that the container's spec refers to."""

    name: str
    namespace: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> Pod:
        meta = doc["metadata"]
        # A pod of generateName is named after admission: five more characters.
        name = meta.get("name") or meta["generateName"] + "x0000"
        return cls(name, meta["namespace"], dict(meta.get("annotations") or {}), dict(meta.get("labels") or {}))


@dataclass(frozen=True)
class Probe:
    """An exec probe as the kubelet runs it: `command` inside the container, answered
    within `timeout` seconds; exit 0 is success."""

    command: tuple[str, ...]
    timeout: float
    period: float
    failure_threshold: int
    initial_delay: float


@dataclass(frozen=True)
class Run:
    """`podman run` arguments (the image and its arguments last) and the container's probes."""

    args: tuple[str, ...]
    probes: Mapping[str, Probe]


def injected(pod_doc: Mapping[str, Any], options: Options) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The agent's container and the pod's volumes by name, after the injector's patch was
    applied by an independent JSON Patch implementation, as the API server would."""
    after = jsonpatch.apply_patch(dict(pod_doc), patch(dict(pod_doc), options))
    (container,) = [c for c in after["spec"]["containers"] if c["name"] == "natgw-agent"]
    return container, {v["name"]: v for v in after["spec"].get("volumes") or []}


def run_args(container: Mapping[str, Any], volumes: Mapping[str, Mapping[str, Any]], pod: Pod,
             host_dirs: Mapping[str, Path], network: str, suffix: str) -> Run:
    """`network`: podman's --network value (the pod's namespace: `ns:/run/netns/NAME`);
    `host_dirs`: volume name -> the host directory holding it; `suffix`: makes the
    container's name unique (the kubelet adds the pod's uid and a restart count)."""
    args = ["--name", f"{container['name']}-{pod.name}-{suffix}", "--network", network, "--hostname", pod.name]
    probes: dict[str, Probe] = {}
    image_args: list[str] = []
    for key, value in container.items():
        if key in ("readinessProbe", "livenessProbe"):
            probes[key.removesuffix("Probe")] = _probe(key, value)
        elif key == "args":
            image_args = [_str(f"args[{i}]", a) for i, a in enumerate(value)]
        elif key == "volumeMounts":
            args += _mounts(value, volumes, host_dirs)
        elif key in _FIELDS:
            args += _FIELDS[key](value, pod)
        else:
            raise UnknownField(key, value)
    if "image" not in container:
        raise UnknownField("image", None)
    return Run((*args, container["image"], *image_args), probes)


def materialize(volume: Mapping[str, Any], pod: Pod, directory: Path, token: str,
                config_maps: Mapping[str, Mapping[str, str]]) -> None:
    """Write a projected volume's files into `directory` as the kubelet lays them out:
    `token` for its serviceAccountToken, `config_maps` (name -> key -> text) for its
    configMap items, the pod's fields for its downwardAPI items; files get defaultMode."""
    projected = volume.get("projected")
    if projected is None or set(volume) != {"name", "projected"}:
        raise UnknownField(f"volumes[{volume.get('name')}]", sorted(volume))
    mode = projected.get("defaultMode", 0o644)
    for i, source in enumerate(projected["sources"]):
        files = _projected_files(f"volumes[{volume['name']}].sources[{i}]", source, pod, token, config_maps)
        for path, text in files.items():
            target = directory / path
            target.write_text(text)
            target.chmod(mode)


def quantity_bytes(path: str, value: str) -> int:
    """A Kubernetes memory quantity (Ki, Mi, Gi or k, M, G or none) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", str(value))
    if not match:
        raise UnknownField(path, value)
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10**3, "M": 10**6, "G": 10**9}
    return int(match[1]) * scale[match[2]]


def _str(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise UnknownField(path, value)
    return value


def _name(value: Any, pod: Pod) -> list[str]:
    return []  # in --name (run_args), beside the pod's name


def _image(value: Any, pod: Pod) -> list[str]:
    return []  # last in the arguments (run_args)


def _pull(value: Any, pod: Pod) -> list[str]:
    policies = {"IfNotPresent": "missing", "Never": "never", "Always": "always"}
    if value not in policies:
        raise UnknownField("imagePullPolicy", value)
    return ["--pull", policies[value]]


def _command(value: Any, pod: Pod) -> list[str]:
    # The whole command as the entrypoint (JSON form): podman then drops the image's CMD,
    # as the kubelet does when a container names a command and no args.
    return ["--entrypoint", json.dumps([_str(f"command[{i}]", c) for i, c in enumerate(value)])]


def _env(value: Any, pod: Pod) -> list[str]:
    args = []
    for i, entry in enumerate(value):
        if set(entry) == {"name", "value"}:
            text = _str(f"env[{i}].value", entry["value"])
        elif set(entry) == {"name", "valueFrom"} and set(entry["valueFrom"]) == {"fieldRef"}:
            text = _field_ref(f"env[{i}].valueFrom.fieldRef", entry["valueFrom"]["fieldRef"], pod)
        else:
            raise UnknownField(f"env[{i}]", entry)
        args += ["--env", f"{entry['name']}={text}"]
    return args


def _field_ref(path: str, ref: Mapping[str, Any], pod: Pod) -> str:
    """The downward API's value of a field, as the kubelet resolves it (a missing
    annotation or label is an empty string)."""
    if set(ref) - {"fieldPath", "apiVersion"}:
        raise UnknownField(path, ref)
    field_path = ref["fieldPath"]
    simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace}
    if field_path in simple:
        return simple[field_path]
    match = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", field_path)
    if not match:
        raise UnknownField(f"{path}.fieldPath", field_path)
    return (pod.annotations if match[1] == "annotations" else pod.labels).get(match[2], "")


def _security(value: Any, pod: Pod) -> list[str]:
    args = []
    for key, item in value.items():
        if key == "runAsUser" and isinstance(item, int) and not isinstance(item, bool):
            args += ["--user", str(item)]
        elif key == "allowPrivilegeEscalation" and isinstance(item, bool):
            # false: the kubelet sets no_new_privs; true is the runtime's default.
            args += ["--security-opt", "no-new-privileges"] if item is False else []
        elif key == "capabilities" and set(item) <= {"drop", "add"}:
            args += [a for cap in item.get("drop", []) for a in ("--cap-drop", _str("capabilities.drop", cap))]
            args += [a for cap in item.get("add", []) for a in ("--cap-add", _str("capabilities.add", cap))]
        else:
            raise UnknownField(f"securityContext.{key}", item)
    return args


def _resources(value: Any, pod: Pod) -> list[str]:
    args = []
    for kind, amounts in value.items():
        for resource, amount in amounts.items():
            path = f"resources.{kind}.{resource}"
            if path == "resources.limits.memory":
                args += ["--memory", str(quantity_bytes(path, amount))]
            elif path == "resources.requests.cpu":
                # The kubelet's MilliCPUToShares: 1024 shares a CPU, at least 2.
                args += ["--cpu-shares", str(max(2, _millicpu(path, amount) * 1024 // 1000))]
            elif path == "resources.limits.cpu":
                args += ["--cpus", str(_millicpu(path, amount) / 1000)]
            elif path in IGNORED:
                quantity_bytes(path, amount)  # still a valid quantity
            else:
                raise UnknownField(path, amount)
    return args


def _millicpu(path: str, value: Any) -> int:
    match = re.fullmatch(r"(\d+)(m?)", str(value))
    if not match:
        raise UnknownField(path, value)
    return int(match[1]) * (1 if match[2] else 1000)


def _mounts(value: Any, volumes: Mapping[str, Mapping[str, Any]], host_dirs: Mapping[str, Path]) -> list[str]:
    args = []
    for i, mount in enumerate(value):
        if set(mount) - {"name", "mountPath", "readOnly"} or mount["name"] not in volumes:
            raise UnknownField(f"volumeMounts[{i}]", mount)
        volume = volumes[mount["name"]]
        kinds = set(volume) - {"name"}
        if kinds not in ({"projected"}, {"emptyDir"}):
            raise UnknownField(f"volumes[{mount['name']}]", sorted(kinds))
        # The kubelet's volumes are host directories bind-mounted into the container (an
        # emptyDir of medium Memory a tmpfs of its own, its sizeLimit enforced by eviction:
        # a host directory here, which is what the container sees either way).
        options = ":ro" if mount.get("readOnly") is True else ""
        args += ["--volume", f"{host_dirs[mount['name']]}:{_str(f'volumeMounts[{i}].mountPath', mount['mountPath'])}"
                             f"{options}"]
    return args


PROBE_FIELDS = {"exec", "timeoutSeconds", "periodSeconds", "failureThreshold", "initialDelaySeconds",
                "successThreshold"}


def _probe(key: str, value: Mapping[str, Any]) -> Probe:
    unknown = set(value) - PROBE_FIELDS
    if unknown or set(value.get("exec") or {}) != {"command"}:
        raise UnknownField(key, sorted(unknown) or value.get("exec"))
    if value.get("successThreshold", 1) != 1:
        raise UnknownField(f"{key}.successThreshold", value["successThreshold"])
    # The kubelet's defaults: 1 s, 10 s, 3, 0.
    return Probe(tuple(_str(f"{key}.exec.command", c) for c in value["exec"]["command"]),
                 float(value.get("timeoutSeconds", 1)), float(value.get("periodSeconds", 10)),
                 int(value.get("failureThreshold", 3)), float(value.get("initialDelaySeconds", 0)))


def _projected_files(path: str, source: Mapping[str, Any], pod: Pod, token: str,
                     config_maps: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    (kind,) = source
    body = source[kind]
    if kind == "serviceAccountToken" and set(body) <= {"path", "expirationSeconds", "audience"}:
        return {body["path"]: token}
    if kind == "configMap" and set(body) <= {"name", "items"}:
        data = config_maps[body["name"]]
        return {item["path"]: data[item["key"]] for item in body["items"]}
    if kind == "downwardAPI" and set(body) == {"items"}:
        return {item["path"]: _field_ref(f"{path}.{item['path']}", item["fieldRef"], pod) for item in body["items"]}
    raise UnknownField(f"{path}.{kind}", body)


_FIELDS: dict[str, Callable[[Any, Pod], list[str]]] = {
    "name": _name, "image": _image, "imagePullPolicy": _pull, "command": _command, "env": _env,
    "securityContext": _security, "resources": _resources,
}
