#!/usr/bin/env python3
"""Offline checks of the deploy files; run through scripts/check-deploy.sh (which installs the
pinned tools and passes --kubectl).

For every kustomize base and overlay under deploy/kubernetes/ (a directory with a
kustomization.yaml), `kubectl kustomize` renders it and each object is checked:

1. Kubernetes' own kinds against Kubernetes' OpenAPI schemas (PyPI kubernetes-validate, strict:
   unknown fields are errors), for each version in K8S_VERSIONS.
2. InferencePool and HTTPRoute against the CRD schemas vendored in deploy/kubernetes/schemas/
   (jsonschema, strict), plus the CRDs' CEL rules that concern these files, written in Python.
   A kind with no schema at all is an error (a typo in apiVersion or kind is caught).
3. References between the objects, which no schema sees: the InferencePool's endpointPickerRef
   names a Service and port that exist and lead to the picker's gRPC port; the picker's
   --pool-name is that pool; its pods are selected by the pool's labels and serve its
   targetPorts; each Service selects pods and its targetPorts exist in them; the picker's
   ServiceAccount is bound to a Role that can get/list/watch pods and inferencepools; the
   HTTPRoute's backendRef is the pool; the gRPC health probes point at the health port; the
   gateway's fleet file is mounted from a ConfigMap, has only fields the gateway reads and names
   pods that exist.
4. Every `--flag` given to `switchyard epp` / `switchyard serve` is in that command's flags table
   (docs/epp.md, docs/gateway.md; crates/cli/tests/docs_sync.rs holds those tables to --help),
   except PENDING_FLAGS, which only warn.
5. deploy/envoy/*.yaml, with their ${...} placeholders filled, parse; and `envoy --mode
   validate` accepts them when .venv/bin/envoy exists.

Then the self-test: each MUTATION breaks one thing in a copy of deploy/ and the check must
report it (with the expected words); a mutation that goes unnoticed fails the run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent

# The oldest Kubernetes these manifests claim (native gRPC probes are GA since 1.27) and the
# newest that kubernetes-validate knows.
K8S_VERSIONS = ["1.29.0", "1.37.0"]

CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.v1-excerpt.yaml",
}

# Flags the manifests use before the docs list them: Kubernetes discovery for `switchyard epp`
# (GIE's reference picker's names) is being added on the k8s-discovery branch. Remove an entry
# once the flag is in the docs table; until then it warns, it does not fail.
PENDING_FLAGS: dict[str, set[str]] = {}

DOC_FLAGS = {"epp": "docs/epp.md", "serve": "docs/gateway.md"}

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    objects: int = 0
    targets: int = 0

    def bad(self, where: str, msg: str) -> None:
        self.problems.append(f"{where}: {msg}")

    def warn(self, where: str, msg: str) -> None:
        self.warnings.append(f"{where}: {msg}")


# ---------------------------------------------------------------------------------------------
# Rendering


def kustomize_targets(root: Path) -> list[Path]:
    base = root / "deploy" / "kubernetes"
    return sorted(p.parent for p in base.glob("*/*/kustomization.yaml"))


def render(kubectl: str, target: Path) -> tuple[list[dict] | None, str]:
    run = subprocess.run(
        [kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60
    )
    if run.returncode != 0:
        return None, run.stderr.strip()
    try:
        docs = [d for d in yaml.safe_load_all(run.stdout) if d is not None]
    except yaml.YAMLError as e:
        return None, f"kustomize output is not YAML: {e}"
    return docs, ""


def ident(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('name')}"


# ---------------------------------------------------------------------------------------------
# Schemas


def strict(schema):
    """The schema with unknown fields refused where it lists properties (kubectl apply's strict
    field validation), except where the CRD keeps unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def load_crd_validators(root: Path) -> dict:
    validators = {}
    for (api_version, kind), name in CRD_SCHEMAS.items():
        crd = yaml.safe_load((root / "deploy" / "kubernetes" / "schemas" / name).read_text())
        version = api_version.split("/")[1]
        (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        schema = strict(ver["schema"]["openAPIV3Schema"])
        jsonschema.Draft7Validator.check_schema(schema)
        validators[(api_version, kind)] = jsonschema.Draft7Validator(schema)
    return validators


def cel_rules(obj: dict) -> list[str]:
    """The CRDs' x-kubernetes-validations that these manifests could break, in Python."""
    out = []
    spec = obj.get("spec") or {}
    if obj["kind"] == "InferencePool":
        ref = spec.get("endpointPickerRef") or {}
        if ref.get("kind", "Service") == "Service" and "port" not in ref:
            out.append("endpointPickerRef: port is required when kind is 'Service' or unspecified")
        numbers = [p.get("number") for p in spec.get("targetPorts") or []]
        if len(numbers) != len(set(numbers)):
            out.append("targetPorts: port number must be unique")
    if obj["kind"] == "HTTPRoute":
        for i, rule in enumerate(spec.get("rules") or []):
            for j, ref in enumerate(rule.get("backendRefs") or []):
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and "port" not in ref:
                    out.append(f"rules[{i}].backendRefs[{j}]: Must have port for Service reference")
            for j, match in enumerate(rule.get("matches") or []):
                path = match.get("path") or {}
                if path.get("type", "PathPrefix") in ("Exact", "PathPrefix") and not str(
                    path.get("value", "/")
                ).startswith("/"):
                    out.append(f"rules[{i}].matches[{j}].path: value must be an absolute path")
    return out


def check_schema(obj: dict, where: str, validators: dict, f: Findings) -> None:
    for key in ("apiVersion", "kind", "metadata"):
        if key not in obj:
            f.bad(where, f"no {key}")
            return
    name = (obj.get("metadata") or {}).get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        f.bad(where, f"metadata.name {name!r} is not a DNS subdomain name")
    validator = validators.get((obj["apiVersion"], obj["kind"]))
    if validator is not None:
        for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
            path = ".".join(str(p) for p in err.path) or "(object)"
            f.bad(where, f"{obj['kind']} schema: {path}: {err.message}")
        for msg in cel_rules(obj):
            f.bad(where, f"{obj['kind']} CEL rule: {msg}")
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            f.bad(where, f"no schema for {obj['apiVersion']} {obj['kind']} (Kubernetes {version} or vendored CRDs)")
            return
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path) or "(object)"
            f.bad(where, f"Kubernetes {version} schema: {path}: {err.message}")
            return


# ---------------------------------------------------------------------------------------------
# References between objects


def pod_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod template) of every workload in the render."""
    out = []
    for d in docs:
        if d.get("kind") in WORKLOAD_KINDS:
            out.append((d, (d.get("spec") or {}).get("template") or {}))
        elif d.get("kind") == "Pod":
            out.append((d, d))
    return out


def labels_of(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(template: dict) -> list[dict]:
    return ((template.get("spec") or {}).get("containers")) or []


def port_map(template: dict) -> tuple[dict, set]:
    names, numbers = {}, set()
    for c in containers(template):
        for p in c.get("ports") or []:
            numbers.add(p.get("containerPort"))
            if "name" in p:
                names[p["name"]] = p.get("containerPort")
    return names, numbers


def resolve_port(template: dict, port) -> int | None:
    names, numbers = port_map(template)
    if isinstance(port, str):
        return names.get(port)
    return port if port in numbers else None


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {(d.get("metadata") or {}).get("name"): d for d in docs if d.get("kind") == kind}


def is_switchyard(container: dict) -> bool:
    """By its image's name, or by its command (an image renamed in an overlay)."""
    image = str(container.get("image", "")).split("@")[0].rsplit(":", 1)[0]
    command = container.get("command") or [""]
    return image.rsplit("/", 1)[-1] == "switchyard" or str(command[0]).rsplit("/", 1)[-1] == "switchyard"


def parse_args(args: list[str]) -> tuple[str | None, dict[str, str | None]]:
    """(subcommand, {--flag: value}) of a switchyard container's args."""
    if not args:
        return None, {}
    sub, flags = args[0], {}
    rest = [str(a) for a in args[1:]]
    i = 0
    while i < len(rest):
        a = rest[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
                flags[k] = v
            elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                flags[a] = rest[i + 1]
                i += 1
            else:
                flags[a] = None
        i += 1
    return sub, flags


def doc_flags(root: Path, sub: str) -> set[str]:
    text = (root / DOC_FLAGS[sub]).read_text()
    section = text.split(f"\n## Flags (`switchyard {sub} --help`)\n", 1)
    if len(section) != 2:
        return set()
    body = section[1].split("\n## ", 1)[0]
    return {"--" + m for m in re.findall(r"^\| `--([a-z0-9-]+)`", body, re.M)}


def check_security(where: str, template: dict, c: dict, f: Findings) -> None:
    pod_sc = (template.get("spec") or {}).get("securityContext") or {}
    sc = c.get("securityContext") or {}
    if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
        f.bad(where, "switchyard must run with runAsNonRoot: true")
    if sc.get("readOnlyRootFilesystem") is not True:
        f.bad(where, "switchyard must run with readOnlyRootFilesystem: true")
    if sc.get("allowPrivilegeEscalation") is not False:
        f.bad(where, "switchyard must run with allowPrivilegeEscalation: false")
    requests = (c.get("resources") or {}).get("requests") or {}
    if not {"cpu", "memory"} <= set(requests):
        f.bad(where, "switchyard needs cpu and memory requests")


def check_epp(where, workload, template, c, flags, docs, f: Findings) -> None:
    pools = by_kind(docs, "InferencePool")
    pool_name = flags.get("--pool-name")
    if not pool_name:
        f.bad(where, "epp without --pool-name (it would not know its pool)")
    elif pools and pool_name not in pools:
        f.bad(where, f"--pool-name={pool_name} names no InferencePool here ({', '.join(sorted(pools))})")
    ns = flags.get("--pool-namespace")
    if ns and ns.startswith("$("):
        var = ns[2:-1]
        env = {e.get("name"): e for e in c.get("env") or []}
        ref = ((env.get(var) or {}).get("valueFrom") or {}).get("fieldRef") or {}
        if ref.get("fieldPath") != "metadata.namespace":
            f.bad(where, f"--pool-namespace={ns}: {var} is not set from metadata.namespace")
    elif ns and ns != (workload.get("metadata") or {}).get("namespace", ns):
        f.bad(where, f"--pool-namespace={ns} is not the namespace the pool is applied to")
    names, numbers = port_map(template)
    ports = {
        "--grpc-port": int(flags.get("--grpc-port") or 9002),
        "--grpc-health-port": int(flags.get("--grpc-health-port") or 9003),
        "--metrics-port": int(flags.get("--metrics-port") or 9090),
    }
    for flag, port in ports.items():
        if port not in numbers:
            f.bad(where, f"{flag} {port} is not a containerPort")
    health = ports["--grpc-health-port"]
    for kind in ("livenessProbe", "readinessProbe"):
        probe = c.get(kind)
        if not probe:
            f.bad(where, f"no {kind}")
            continue
        grpc = probe.get("grpc")
        if not grpc:
            f.bad(where, f"{kind} is not a grpc probe (the picker's health is grpc.health.v1)")
            continue
        if resolve_port(template, grpc.get("port")) != health:
            f.bad(where, f"{kind} probes port {grpc.get('port')}, not the gRPC health port {health}")
        if grpc.get("service", "") not in ("", EXT_PROC_SERVICE):
            f.bad(where, f"{kind} asks for service {grpc.get('service')!r}, which the picker does not report")
    drain = float(flags.get("--drain-timeout") or 30)
    grace = (template.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
    if grace <= drain:
        f.bad(where, f"terminationGracePeriodSeconds {grace} is not above --drain-timeout {drain:g}")
    # The ServiceAccount must be able to read the pool and its pods.
    sa = (template.get("spec") or {}).get("serviceAccountName", "default")
    roles = by_kind(docs, "Role")
    needed = {("", "pods"), ("inference.networking.k8s.io", "inferencepools")}
    granted = set()
    for rb in by_kind(docs, "RoleBinding").values():
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa for s in rb.get("subjects") or []):
            continue
        role = roles.get((rb.get("roleRef") or {}).get("name"))
        for rule in (role or {}).get("rules") or []:
            if {"get", "list", "watch"} <= set(rule.get("verbs") or []):
                for g in rule.get("apiGroups") or []:
                    for r in rule.get("resources") or []:
                        granted.add((g, r))
    for g, r in sorted(needed - granted):
        f.bad(where, f"ServiceAccount {sa} may not get/list/watch {r} ({g or 'core'} group)")
    # Some Service must carry the ext_proc port to these pods.
    grpc_port = ports["--grpc-port"]
    reach = [
        s for s in by_kind(docs, "Service").values()
        if selects((s.get("spec") or {}).get("selector") or {}, labels_of(template))
        and any(resolve_port(template, p.get("targetPort", p.get("port"))) == grpc_port for p in (s.get("spec") or {}).get("ports") or [])
    ]
    if not reach:
        f.bad(where, f"no Service carries the ext_proc port {grpc_port} to the picker's pods")


# The fleet file's fields, as the gateway reads them: both structs refuse unknown fields
# (serde deny_unknown_fields: FleetFile in crates/gateway/src/config.rs, BackendSpec in
# crates/gateway/src/backends.rs), so a typo stops the gateway at start.
FLEET_KEYS = {"backends", "model_aliases"}
BACKEND_KEYS = {
    "name", "address", "role", "models", "adapters", "weight", "labels", "kind",
    "adapter_slots", "kv_capacity_tokens", "bootstrap_port", "kv_events", "kv_events_replay",
}
ROLES = {"prefill", "decode", "both"}
ENGINE_KINDS = {"auto", "vllm", "sglang", "llamacpp", "trtllm"}


def rust_struct_fields(path: Path, struct: str) -> set[str]:
    """The field names of `pub struct NAME { ... }` in a Rust file (no serde renames there)."""
    text = path.read_text()
    body = text.split(f"pub struct {struct} {{", 1)[1].split("\n}", 1)[0]
    return set(re.findall(r"^\s*pub (\w+):", body, re.M))


def fleet_keys_in_sync(root: Path) -> list[str]:
    """The fields above against the Rust structs, so that this check cannot drift from them."""
    out = []
    for path, struct, ours in (
        ("crates/gateway/src/config.rs", "FleetFile", FLEET_KEYS),
        ("crates/gateway/src/backends.rs", "BackendSpec", BACKEND_KEYS),
    ):
        theirs = rust_struct_fields(root / path, struct)
        if theirs != ours:
            out.append(f"{path} {struct} has fields {sorted(theirs)}, scripts/check_deploy.py knows {sorted(ours)}")
    return out


def fleet_shape(doc: dict) -> list[str]:
    out = [f"unknown field `{k}`" for k in sorted(set(doc) - FLEET_KEYS)]
    for i, b in enumerate(doc.get("backends") or []):
        if not isinstance(b, dict):
            out.append(f"backends[{i}] is not a mapping")
            continue
        out += [f"backends[{i}]: unknown field `{k}`" for k in sorted(set(b) - BACKEND_KEYS)]
        if not b.get("address"):
            out.append(f"backends[{i}]: no address")
        if "role" in b and b["role"] not in ROLES:
            out.append(f"backends[{i}]: role {b['role']!r} is not one of {sorted(ROLES)}")
        if "kind" in b and b["kind"] not in ENGINE_KINDS:
            out.append(f"backends[{i}]: kind {b['kind']!r} is not one of {sorted(ENGINE_KINDS)}")
    return out


def check_serve(where, template, c, flags, docs, f: Findings) -> None:
    listen = flags.get("--listen")
    if not listen:
        f.bad(where, "serve without --listen listens on 127.0.0.1:8080, unreachable from outside the pod")
    else:
        host, _, port = listen.rpartition(":")
        if host.strip("[]") in ("127.0.0.1", "localhost", "::1"):
            f.bad(where, f"--listen={listen} is loopback, unreachable from outside the pod")
        _, numbers = port_map(template)
        if port.isdigit() and int(port) not in numbers:
            f.bad(where, f"--listen port {port} is not a containerPort")
    if not c.get("readinessProbe"):
        f.bad(where, "no readinessProbe")
    fleet = flags.get("--fleet-file")
    if not fleet:
        if "--backend" not in flags:
            f.bad(where, "serve with neither --fleet-file nor --backend")
        return
    volumes = {v.get("name"): v for v in (template.get("spec") or {}).get("volumes") or []}
    mount = next(
        (m for m in c.get("volumeMounts") or [] if fleet.startswith(m.get("mountPath", "").rstrip("/") + "/")),
        None,
    )
    if mount is None:
        f.bad(where, f"--fleet-file {fleet} is under no volumeMount")
        return
    if mount.get("subPath"):
        f.bad(where, "the fleet file's mount uses subPath, which never sees ConfigMap updates")
    cm_name = ((volumes.get(mount.get("name")) or {}).get("configMap") or {}).get("name")
    cm = by_kind(docs, "ConfigMap").get(cm_name)
    key = fleet[len(mount["mountPath"].rstrip("/")) + 1 :]
    if cm is None or key not in (cm.get("data") or {}):
        f.bad(where, f"--fleet-file {fleet}: no ConfigMap {cm_name} with key {key} here")
        return
    try:
        fleet_doc = yaml.safe_load(cm["data"][key])
    except yaml.YAMLError as e:
        f.bad(where, f"fleet file in ConfigMap {cm_name} is not YAML: {e}")
        return
    backends = (fleet_doc or {}).get("backends") if isinstance(fleet_doc, dict) else None
    if not isinstance(backends, list):
        f.bad(where, f"fleet file in ConfigMap {cm_name} has no `backends` list")
        return
    for msg in fleet_shape(fleet_doc):
        f.bad(where, f"fleet file in ConfigMap {cm_name}: {msg}")
    services = by_kind(docs, "Service")
    sets = {(s.get("spec") or {}).get("serviceName"): s for s in by_kind(docs, "StatefulSet").values()}
    for b in backends:
        address = str((b or {}).get("address", ""))
        m = re.match(r"^(?:https?://)?([^/:]+)(?::(\d+))?", address)
        if not m:
            f.bad(where, f"fleet backend without an address: {b}")
            continue
        host, port = m.group(1), m.group(2)
        parts = host.split(".")
        if len(parts) >= 2 and parts[1] in sets:
            sts = sets[parts[1]]
            sts_name = sts["metadata"]["name"]
            ordinal = parts[0].removeprefix(sts_name + "-")
            replicas = (sts.get("spec") or {}).get("replicas", 1)
            if not ordinal.isdigit() or int(ordinal) >= replicas:
                f.bad(where, f"fleet backend {address}: StatefulSet {sts_name} has no pod {parts[0]} ({replicas} replicas)")
            svc = services.get(parts[1])
            if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
                f.bad(where, f"fleet backend {address}: per-pod names need the headless Service {parts[1]}")
            tpl = (sts.get("spec") or {}).get("template") or {}
            if port and resolve_port(tpl, int(port)) is None:
                f.bad(where, f"fleet backend {address}: port {port} is not a containerPort of {sts_name}")
        elif len(parts) == 1 and parts[0] in services and (services[parts[0]].get("spec") or {}).get("clusterIP") != "None":
            f.bad(where, f"fleet backend {address} is a load-balanced Service: the router would see one backend, not its pods")


def check_references(target: str, docs: list[dict], root: Path, f: Findings) -> None:
    seen = Counter((d.get("kind"), (d.get("metadata") or {}).get("name")) for d in docs)
    for (kind, name), n in seen.items():
        if n > 1:
            f.bad(target, f"{kind}/{name} appears {n} times")
    templates = pod_templates(docs)
    model_servers = [
        (w, t) for w, t in templates if not any(is_switchyard(c) for c in containers(t))
    ]
    services = by_kind(docs, "Service")
    # Services select pods and their targetPorts exist there.
    for name, svc in services.items():
        selector = (svc.get("spec") or {}).get("selector") or {}
        chosen = [t for _, t in templates if selects(selector, labels_of(t))]
        if not chosen:
            f.bad(f"{target} Service/{name}", f"selector {selector} matches no pods here")
            continue
        for p in (svc.get("spec") or {}).get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            if any(resolve_port(t, tp) is None for t in chosen):
                f.bad(f"{target} Service/{name}", f"targetPort {tp} is not a port of the pods it selects")
    # RoleBindings bind what exists.
    roles, sas = by_kind(docs, "Role"), by_kind(docs, "ServiceAccount")
    for name, rb in by_kind(docs, "RoleBinding").items():
        ref = rb.get("roleRef") or {}
        if ref.get("kind") == "Role" and ref.get("name") not in roles:
            f.bad(f"{target} RoleBinding/{name}", f"binds Role {ref.get('name')}, which is not here")
        rb_ns = (rb.get("metadata") or {}).get("namespace")
        for s in rb.get("subjects") or []:
            if s.get("kind") != "ServiceAccount":
                continue
            if s.get("name") not in sas:
                f.bad(f"{target} RoleBinding/{name}", f"subject ServiceAccount {s.get('name')} is not here")
                continue
            sa_ns = (sas[s["name"]].get("metadata") or {}).get("namespace")
            if rb_ns and s.get("namespace", rb_ns) != sa_ns:
                f.bad(f"{target} RoleBinding/{name}",
                      f"binds ServiceAccount {s['name']} in namespace {s.get('namespace')}, but it is in {sa_ns}")
    # Workloads run as ServiceAccounts that exist.
    for w, t in templates:
        sa = (t.get("spec") or {}).get("serviceAccountName")
        if sa and sa not in sas:
            f.bad(f"{target} {ident(w)}", f"serviceAccountName {sa} is not here")
    # The pool.
    pools = by_kind(docs, "InferencePool")
    for name, pool in pools.items():
        where = f"{target} InferencePool/{name}"
        spec = pool.get("spec") or {}
        ref = spec.get("endpointPickerRef") or {}
        if ref.get("kind", "Service") == "Service":
            svc = services.get(ref.get("name"))
            number = (ref.get("port") or {}).get("number")
            if svc is None:
                f.bad(where, f"endpointPickerRef names Service {ref.get('name')}, which is not here")
            elif number not in [p.get("port") for p in (svc.get("spec") or {}).get("ports") or []]:
                f.bad(where, f"endpointPickerRef port {number} is not a port of Service {ref.get('name')}")
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        members = [(w, t) for w, t in model_servers if selects(selector, labels_of(t))]
        if model_servers and not members:
            f.bad(where, f"selector {selector} matches none of the model servers here "
                  f"({', '.join(ident(w) for w, _ in model_servers)})")
        for w, t in members:
            for p in spec.get("targetPorts") or []:
                if resolve_port(t, p.get("number")) is None:
                    f.bad(where, f"targetPort {p.get('number')} is not a containerPort of {ident(w)}")
    for name, route in by_kind(docs, "HTTPRoute").items():
        for rule in (route.get("spec") or {}).get("rules") or []:
            for ref in rule.get("backendRefs") or []:
                if ref.get("kind") == "InferencePool" and ref.get("name") not in pools:
                    f.bad(f"{target} HTTPRoute/{name}", f"backendRef InferencePool {ref.get('name')} is not here")
                if ref.get("kind") == "InferencePool" and ref.get("group") != "inference.networking.k8s.io":
                    f.bad(f"{target} HTTPRoute/{name}", "an InferencePool backendRef needs group inference.networking.k8s.io")
    # switchyard itself.
    for w, t in templates:
        for c in containers(t):
            if not is_switchyard(c):
                continue
            where = f"{target} {ident(w)} container {c.get('name')}"
            sub, flags = parse_args(c.get("args") or [])
            if sub not in DOC_FLAGS:
                f.bad(where, f"first argument {sub!r} is not a subcommand these files know (epp, serve)")
                continue
            known = doc_flags(root, sub)
            for flag in flags:
                if flag in known:
                    continue
                if flag in PENDING_FLAGS.get(sub, set()):
                    f.warn(where, f"{flag} is not in {DOC_FLAGS[sub]} yet (Kubernetes discovery, pending)")
                else:
                    f.bad(where, f"switchyard {sub} has no flag {flag} (not in {DOC_FLAGS[sub]})")
            check_security(where, t, c, f)
            if sub == "epp":
                check_epp(where, w, t, c, flags, docs, f)
            else:
                check_serve(where, t, c, flags, docs, f)


# ---------------------------------------------------------------------------------------------
# Envoy bootstrap files

ENVOY_VALUES = {
    "ADMIN_PORT": "0",
    "LISTEN_PORT": "0",
    "EPP_PORT": "9002",
    "RESPONSE_BODY_MODE": "FULL_DUPLEX_STREAMED",
    "ENDPOINTS": "              - endpoint:\n                  address:\n"
    "                    socket_address: { address: 127.0.0.1, port_value: 8000 }",
}


def check_envoy(root: Path, f: Findings, envoy: Path | None) -> int:
    files = sorted((root / "deploy" / "envoy").glob("*.yaml"))
    for path in files:
        where = f"deploy/envoy/{path.name}"
        text = path.read_text()
        for k, v in ENVOY_VALUES.items():
            text = text.replace("${" + k + "}", v)
        left = re.findall(r"\$\{([A-Z_]+)\}", text)
        if left:
            f.bad(where, f"unknown placeholders {left}")
            continue
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            f.bad(where, f"not YAML once filled in: {e}")
            continue
        if not isinstance(doc, dict) or "static_resources" not in doc:
            f.bad(where, "no static_resources")
            continue
        if envoy is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as tmp:
                tmp.write(text)
                tmp.flush()
                run = subprocess.run(
                    [str(envoy), "--mode", "validate", "-c", tmp.name, "--log-level", "error"],
                    capture_output=True, text=True, timeout=60,
                )
            if run.returncode != 0:
                tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
                f.bad(where, "envoy --mode validate: " + " | ".join(tail))
    return len(files)


# ---------------------------------------------------------------------------------------------


def check_tree(root: Path, kubectl: str, envoy: Path | None, verbose: bool) -> Findings:
    f = Findings()
    validators = load_crd_validators(root)
    for target in kustomize_targets(root):
        name = str(target.relative_to(root / "deploy" / "kubernetes"))
        docs, err = render(kubectl, target)
        f.targets += 1
        if docs is None:
            f.bad(name, f"kubectl kustomize failed: {err}")
            continue
        for obj in docs:
            check_schema(obj, f"{name} {ident(obj)}", validators, f)
        f.objects += len(docs)
        check_references(name, docs, root, f)
        if verbose:
            kinds = Counter(d.get("kind") for d in docs)
            print(f"  rendered {name}: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    if not f.targets:
        f.bad("deploy/kubernetes", "no kustomization found")
    if (root / "crates").exists():
        for msg in fleet_keys_in_sync(root):
            f.bad("fleet file fields", msg)
    n = check_envoy(root, f, envoy)
    if verbose:
        print(f"  deploy/envoy: {n} files" + (" (parsed, envoy --mode validate)" if envoy else " (parsed; no .venv/bin/envoy)"))
    return f


# Each mutation breaks one thing in a copy of deploy/ (file, text, replacement) and names words
# the check must then report. All must be caught.
MUTATIONS = [
    ("pool points at a port the picker's Service lacks",
     "kubernetes/base/epp/inferencepool.yaml", "      number: 9002", "      number: 9012",
     "endpointPickerRef port 9012"),
    ("misspelt pool field",
     "kubernetes/base/epp/inferencepool.yaml", "  endpointPickerRef:", "  endpointPickerref:",
     "'endpointPickerRef' is a required property"),
    ("pool targetPort out of range",
     "kubernetes/base/epp/inferencepool.yaml", "  - number: 8000", "  - number: 80000",
     "80000 is greater than the maximum"),
    ("pool without the port of its Service reference",
     "kubernetes/base/epp/inferencepool.yaml", "    port:\n      number: 9002\n", "",
     "port is required when kind is 'Service'"),
    ("route to a pool that does not exist",
     "kubernetes/base/epp/httproute.yaml", "      name: vllm-pool", "      name: vllm-pol",
     "backendRef InferencePool vllm-pol"),
    ("route timeout that is no Gateway API duration",
     "kubernetes/base/epp/httproute.yaml", "request: 600s", "request: 10 minutes",
     "does not match"),
    ("containerPort as a string",
     "kubernetes/base/epp/deployment.yaml", "containerPort: 9002", 'containerPort: "9002"',
     "'9002' is not of type 'integer'"),
    ("liveness probe on the wrong port",
     "kubernetes/base/epp/deployment.yaml", "        livenessProbe:\n          grpc:\n            port: 9003",
     "        livenessProbe:\n          grpc:\n            port: 9090", "livenessProbe probes port 9090"),
    ("readiness as HTTP instead of gRPC",
     "kubernetes/base/epp/deployment.yaml",
     "          grpc:\n            port: 9003\n            service: envoy.service.ext_proc.v3.ExternalProcessor",
     "          httpGet:\n            path: /health\n            port: 9090",
     "readinessProbe is not a grpc probe"),
    ("RBAC without list/watch on inferencepools",
     "kubernetes/base/epp/rbac.yaml", '  resources: ["inferencepools"]\n  verbs: ["get", "list", "watch"]',
     '  resources: ["inferencepools"]\n  verbs: ["get"]', "may not get/list/watch inferencepools"),
    ("RoleBinding naming the ServiceAccount in another namespace",
     "kubernetes/base/epp/rbac.yaml", "  namespace: default", "  namespace: kube-system",
     "binds ServiceAccount switchyard-epp in namespace kube-system"),
    ("picker told another pool",
     "kubernetes/base/epp/deployment.yaml", "--pool-name=vllm-pool", "--pool-name=other-pool",
     "--pool-name=other-pool names no InferencePool"),
    ("a flag switchyard epp does not have",
     "kubernetes/base/epp/deployment.yaml", "--max-fallbacks=0", "--max-fallback=0",
     "has no flag --max-fallback"),
    ("writable root filesystem",
     "kubernetes/base/epp/deployment.yaml", "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false",
     "readOnlyRootFilesystem: true"),
    ("Service selecting nothing",
     "kubernetes/base/epp/service.yaml", "app.kubernetes.io/name: switchyard-epp", "app.kubernetes.io/name: switchyard-ep",
     "matches no pods here"),
    ("overlay's pool labels match no vLLM pod",
     "kubernetes/overlays/epp-vllm/kustomization.yaml", "        app: vllm-qwen3", "        app: vllm-qwen",
     "matches none of the model servers"),
    ("kustomization pointing at a missing base",
     "kubernetes/overlays/epp-vllm/kustomization.yaml", "- ../../base/epp", "- ../../base/ep",
     "kubectl kustomize failed"),
    ("gateway listening on loopback",
     "kubernetes/base/serve/deployment.yaml", "--listen=0.0.0.0:8080", "--listen=127.0.0.1:8080",
     "is loopback"),
    ("fleet naming a pod the StatefulSet does not have",
     "kubernetes/base/serve/fleet.yaml", "http://vllm-1.vllm:8000", "http://vllm-2.vllm:8000",
     "has no pod vllm-2"),
    ("fleet file with a field the gateway does not know",
     "kubernetes/base/serve/fleet.yaml", "name: vllm-1", "nmae: vllm-1",
     "backends[1]: unknown field `nmae`"),
    ("fleet file mounted with subPath",
     "kubernetes/base/serve/deployment.yaml", "          mountPath: /etc/switchyard/fleet\n",
     "          mountPath: /etc/switchyard/fleet\n          subPath: fleet.yaml\n", "subPath"),
    ("apiVersion typo",
     "kubernetes/base/epp/inferencepool.yaml", "inference.networking.k8s.io/v1\n", "inference.networking.k8s.io/v1beta9\n",
     "no schema for inference.networking.k8s.io/v1beta9 InferencePool"),
    ("Envoy file broken",
     "envoy/epp-standalone.yaml", "static_resources:", "static_resources: [",
     "not YAML once filled in"),
    ("Envoy file with a filter Envoy does not know (needs .venv/bin/envoy)",
     "envoy/epp-standalone.yaml", "http_connection_manager.v3.HttpConnectionManager\n",
     "http_connection_manager.v3.HttpConnectionManagr\n", "envoy --mode validate"),
]


def self_test(kubectl: str, envoy: Path | None) -> tuple[list[str], int]:
    """(what went unnoticed, how many mutations ran)."""
    failures, ran = [], 0
    with tempfile.TemporaryDirectory(prefix="check-deploy-") as tmp:
        root = Path(tmp)
        shutil.copytree(ROOT / "deploy", root / "deploy")
        shutil.copytree(ROOT / "docs", root / "docs")
        for what, rel, old, new, expect in MUTATIONS:
            path = root / "deploy" / rel
            text = path.read_text()
            if text.count(old) != 1:
                failures.append(f"mutation '{what}': {rel} holds {text.count(old)} copies of the text to change")
                continue
            if expect == "envoy --mode validate" and envoy is None:
                continue
            ran += 1
            path.write_text(text.replace(old, new))
            try:
                # Envoy's own validation only where an Envoy file is broken (it costs time).
                found = check_tree(root, kubectl, envoy if rel.startswith("envoy/") else None, verbose=False)
            finally:
                path.write_text(text)
            if not any(expect in p for p in found.problems):
                got = "; ".join(found.problems[:3]) or "no problem at all"
                failures.append(f"mutation '{what}' not caught as expected ({expect!r}); reported: {got}")
    return failures, ran


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--no-self-test", action="store_true")
    opts = ap.parse_args()
    started = time.monotonic()
    envoy = ROOT / ".venv" / "bin" / "envoy"
    envoy = envoy if envoy.exists() else None
    version = subprocess.run([opts.kubectl, "version", "--client"], capture_output=True, text=True)
    print("check-deploy: " + " / ".join(version.stdout.split("\n")[:2]).strip())
    found = check_tree(ROOT, opts.kubectl, envoy, verbose=True)
    for w in found.warnings:
        print(f"  warning: {w}")
    for p in found.problems:
        print(f"  FAIL {p}")
    failures, ran = ([], 0) if opts.no_self_test else self_test(opts.kubectl, envoy)
    for msg in failures:
        print(f"  SELF-TEST FAIL {msg}")
    caught = ran - len(failures)
    print(
        f"check-deploy: {found.targets} renders, {found.objects} objects, "
        f"{len(found.problems)} problems, {len(found.warnings)} warnings; "
        + ("self-test skipped" if opts.no_self_test else f"{caught} of {ran} broken copies caught")
        + f" ({time.monotonic() - started:.1f} s)"
    )
    return 1 if found.problems or failures else 0


if __name__ == "__main__":
    sys.exit(main())
