"""Pods as Kubernetes would run them, from the rendered manifests: each Deployment's container (command,
args with $(VAR) expanded, env from its ConfigMap, Secrets and field refs, emptyDir volumes, uid, read-only
root, capabilities, CPU and memory limits) as an OCI runtime config for runc, on a buildah container of the
image (scripts/image_job.py runs them)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# runc's own defaults (`runc spec`): what every container gets besides its volumes.
BASE_MOUNTS = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755",
                                                                             "size=65536k"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
     "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
     "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
]
MASKED_PATHS = ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
CAPABILITY_SETS = ("bounding", "effective", "inheritable", "permitted", "ambient")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|m)?$")
_FACTORS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
            "m": 10**-3}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("2Gi", "500m", "2") as a number."""
    found = _QUANTITY.match(str(text))
    if found is None:
        raise ValueError(f"cannot read the quantity {text!r}")
    return float(found.group(1)) * _FACTORS[found.group(2)]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, an undefined one left as is, $$ is $."""
    return re.sub(r"\$\$|\$\((\w+)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass
class PodSpec:
    """One Deployment's pod, resolved for one address."""
    tier: str
    name: str
    labels: dict[str, str]
    args: list[str]
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int]
    read_only_root: bool
    capabilities: list[str]
    no_new_privileges: bool
    tmpfs: dict[str, int] = field(default_factory=dict)  # mount path -> size in bytes
    cpu_limit: float | None = None
    memory_limit: int | None = None
    container: dict = field(default_factory=dict)


def _env(container: dict, docs: list[dict], pod: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(next(d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name))
    fields = {"status.podIP": pod["ip"], "metadata.name": pod["name"], "metadata.namespace": pod["namespace"]}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            if ref["name"] in secrets:
                env[entry["name"]] = secrets[ref["name"]][ref["key"]]
            elif not ref.get("optional"):
                raise ValueError(f"{pod['name']}: no Secret {ref['name']} given for {entry['name']}")
    return env


def _capabilities(security: dict) -> list[str]:
    capabilities = security.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        raise ValueError("only containers that drop ALL capabilities are run here")
    return [f"CAP_{name}" for name in capabilities.get("add", [])]


def _tmpfs(container: dict, volumes: list[dict]) -> dict[str, int]:
    by_name = {volume["name"]: volume for volume in volumes}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        volume = by_name[mount["name"]]
        if "emptyDir" not in volume:
            raise ValueError(f"volume {mount['name']}: only emptyDir volumes are run here")
        mounts[mount["mountPath"]] = int(quantity(volume["emptyDir"].get("sizeLimit", "256Mi")))
    return mounts


def pod_spec(docs: list[dict], deployment: str, ip: str, secrets: dict[str, dict[str, str]]) -> PodSpec:
    """The pod of the Deployment named deployment, as it would run with the address ip."""
    found = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment)
    template = found["spec"]["template"]
    spec, container = template["spec"], template["spec"]["containers"][0]
    pod = {"ip": ip, "name": f"{deployment}-0", "namespace": found["metadata"].get("namespace", "default")}
    env = _env(container, docs, pod, secrets)
    pod_security, security = spec.get("securityContext", {}), container.get("securityContext", {})
    limits = container.get("resources", {}).get("limits", {})
    return PodSpec(
        tier=container["name"], name=pod["name"], labels=template["metadata"]["labels"],
        args=[expand(arg, env) for arg in container.get("command", []) + container.get("args", [])], env=env,
        uid=security.get("runAsUser", pod_security["runAsUser"]),
        gid=security.get("runAsGroup", pod_security["runAsGroup"]),
        groups=[pod_security["fsGroup"]] if "fsGroup" in pod_security else [],
        read_only_root=bool(security.get("readOnlyRootFilesystem")), capabilities=_capabilities(security),
        no_new_privileges=security.get("allowPrivilegeEscalation") is False,
        tmpfs=_tmpfs(container, spec.get("volumes", [])),
        cpu_limit=quantity(limits["cpu"]) if "cpu" in limits else None,
        memory_limit=int(quantity(limits["memory"])) if "memory" in limits else None, container=container,
    )


def _mounts(pod: PodSpec, etc_files: dict[str, Path]) -> list[dict]:
    mounts = [m for m in BASE_MOUNTS if m["destination"] not in pod.tmpfs]
    for path, size in pod.tmpfs.items():
        mounts.append({"destination": path, "type": "tmpfs", "source": "tmpfs",
                       "options": ["nosuid", "nodev", "mode=1777", f"size={size}"]})
    # What kubelet bind-mounts into every container: its /etc/hosts, /etc/hostname and /etc/resolv.conf.
    for destination, source in etc_files.items():
        mounts.append({"destination": destination, "type": "bind", "source": str(source),
                       "options": ["rbind", "ro"]})
    return mounts


def _resources(pod: PodSpec) -> dict:
    resources: dict = {}
    if pod.cpu_limit is not None:
        resources["cpu"] = {"period": 100_000, "quota": int(pod.cpu_limit * 100_000)}
    if pod.memory_limit is not None:
        resources["memory"] = {"limit": pod.memory_limit}
    return resources


def oci_config(pod: PodSpec, image_config: dict, rootfs: str, netns: str, etc_files: dict[str, Path]) -> dict:
    """The runc config.json of the pod's container: its own PID, mount, IPC, UTS and cgroup namespaces, and
    the network namespace netns (a path under /run/netns)."""
    image_env = dict(entry.split("=", 1) for entry in image_config.get("Env", []))
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": pod.uid, "gid": pod.gid, "additionalGids": pod.groups},
            "args": pod.args, "cwd": image_config.get("WorkingDir") or "/",
            "env": [f"{key}={value}" for key, value in {**image_env, **pod.env}.items()],
            "capabilities": {name: list(pod.capabilities) for name in CAPABILITY_SETS},
            "noNewPrivileges": pod.no_new_privileges,
        },
        "root": {"path": rootfs, "readonly": pod.read_only_root},
        "hostname": pod.name,
        "mounts": _mounts(pod, etc_files),
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
                           {"type": "cgroup"}, {"type": "network", "path": netns}],
            "cgroupsPath": f"/pdserve-image-check/{pod.name}",
            "resources": _resources(pod),
            "maskedPaths": MASKED_PATHS, "readonlyPaths": READONLY_PATHS,
        },
    }


def write_bundle(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
