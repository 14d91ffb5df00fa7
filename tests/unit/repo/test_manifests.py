"""The cluster manifests under infra/k8s: parsed and cross-checked, since no cluster runs here.

Checks that fail on a broken manifest: every document parses and names itself; no credential is written
in any file (only secretKeyRef); every Service, NetworkPolicy, StatefulSet serviceName, Job subdomain,
ServiceAccount, PVC and ConfigMap reference points at something that exists; the sglang-router command uses
the flags infra/router.py uses (plus Kubernetes service discovery) and parses with sglang-router's own parser;
the SGLang command uses infra/sglang_launcher.py's flags; the trainer's torchrun command parses with torch's
parser and agrees with the Job's size and GPUs; the work pool's base job template renders with Prefect's
templating, accepts the job variables `sluiceway serve --pool` sends, and keeps credentials in Secrets.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from paths import ROOT

ROOT = ROOT
K8S = ROOT / "infra" / "k8s"
TEMPLATE = K8S / "prefect" / "base-job-template.json"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
# Environment variable names that hold credentials: they may only come from a Secret.
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|TOKEN|API_KEY|AUTHKEY|AUTH_STRING|ACCESS_KEY|CONNECTION_URL)", re.I)
# Keys of Helm values whose value would be a credential if set.
SECRET_VALUE_KEYS = {"password", "authString", "apiKey", "connectionString", "secretKey"}


def yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def is_values(path: Path) -> bool:
    return "values" in path.name


def documents() -> list[tuple[Path, dict]]:
    out = []
    for path in yaml_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def manifests() -> list[tuple[Path, dict]]:
    """Kubernetes objects (not Helm values, not the Kustomization)."""
    return [(p, d) for p, d in documents() if not is_values(p) and d.get("kind") != "Kustomization"]


def base_job_template() -> dict:
    return json.loads(TEMPLATE.read_text())


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: dict) -> dict:
    return obj["spec"]["template"].get("metadata", {}).get("labels", {})


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def flags(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def arg_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def arg_values(args: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next flag (nargs='+')."""
    i = args.index(flag) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def walk(node, path=""):
    """Every (path, key, value) of a nested structure."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def env_lists(node):
    """Every container `env` list in a manifest (containers and initContainers alike)."""
    for _, key, value in walk(node):
        if key == "env" and isinstance(value, list):
            yield value


def all_objects() -> list[dict]:
    """Manifests plus the Job the work pool template describes (for cross-references)."""
    return [d for _, d in manifests()] + [base_job_template()["job_configuration"]["job_manifest"]]


def the(kind: str, name_part: str) -> dict:
    found = [d for _, d in manifests() if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"expected one {kind} named like {name_part!r}, found {len(found)}"
    return found[0]


def container(obj: dict) -> dict:
    return pod_spec(obj)["containers"][0]


# --- every document ------------------------------------------------------------------------------------------


def test_there_are_manifests():
    kinds = {d["kind"] for _, d in manifests()}
    assert {"Deployment", "StatefulSet", "Service", "Job", "NetworkPolicy", "PersistentVolumeClaim"} <= kinds
    assert any(is_values(p) for p in yaml_files()), "the Prefect Helm values files are missing"


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_document_parses_and_names_itself(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
        if is_values(path):
            assert "apiVersion" not in doc, f"{path}: a values file should not be a Kubernetes object"
            continue
        assert doc.get("apiVersion"), f"{path}: no apiVersion"
        assert doc.get("kind"), f"{path}: no kind"
        if doc["kind"] != "Kustomization":
            assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without metadata.name"


def test_kustomization_lists_every_manifest():
    kfile = K8S / "kustomization.yaml"
    kust = yaml.safe_load(kfile.read_text())
    text = kfile.read_text()
    listed = set(kust["resources"])
    for path in listed:
        assert (K8S / path).is_file(), f"kustomization.yaml lists {path}, which does not exist"
    for gen in kust.get("configMapGenerator", []):
        for entry in gen["files"]:
            assert (K8S / entry.split("=", 1)[-1]).is_file(), f"configMapGenerator file {entry} is missing"
    for path in yaml_files():
        rel = str(path.relative_to(K8S))
        if is_values(path) or rel == "kustomization.yaml" or rel in listed:
            continue
        # A manifest left out on purpose is named in a commented-out line that says why.
        assert f"# - {rel}" in text, f"{rel} is neither in kustomization.yaml's resources nor commented there"
    names = [(d["kind"], d["metadata"]["name"]) for _, d in manifests()]
    assert len(names) == len(set(names)), f"duplicate objects: {sorted(n for n in names if names.count(n) > 1)}"


# --- no credentials in any file -----------------------------------------------------------------------------


def test_no_literal_secret_values():
    sources = [(p, d) for p, d in documents()] + [(TEMPLATE, base_job_template())]
    for path, doc in sources:
        if doc.get("kind") == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), f"{path}: a Secret with values in a file"
        for env in env_lists(doc):
            for entry in env:
                if SECRET_NAME.search(entry["name"]):
                    assert "value" not in entry, f"{path}: {entry['name']} has a literal value"
                    assert "secretKeyRef" in entry.get("valueFrom", {}), f"{path}: {entry['name']} not from a Secret"
        for where, key, value in walk(doc):
            if key in SECRET_VALUE_KEYS and isinstance(value, str):
                assert not value, f"{path}: {where}.{key} holds a credential"
            if isinstance(value, str):
                assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", value), f"{path}: {where}.{key}: URL with a password"
                assert not re.search(r"\bAKIA[0-9A-Z]{16}\b", value), f"{path}: {where}.{key}: an AWS access key"
    for path in [*yaml_files(), TEMPLATE]:  # also comments, which the parser drops
        assert not re.search(r"\bAKIA[0-9A-Z]{16}\b", path.read_text()), f"{path}: an AWS access key"


def test_every_secret_used_is_documented():
    """Secrets are created by hand with kubectl: docs/deploy.md must say how, for every one referenced."""
    docs_text = (ROOT / "docs" / "deploy.md").read_text()
    refs = {v["name"] for obj in all_objects() for _, k, v in walk(obj) if k == "secretKeyRef"}
    refs |= {yaml.safe_load((K8S / "prefect" / "server-values.yaml").read_text())["secret"]["name"]}
    assert refs, "no secretKeyRef anywhere"
    for name in sorted(refs):
        assert f"create secret generic {name}" in docs_text, f"docs/deploy.md does not say how to create {name}"


# --- references between objects -----------------------------------------------------------------------------


def test_workload_selectors_match_their_pods():
    for path, obj in manifests():
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            sel = obj["spec"]["selector"]["matchLabels"]
            assert matches(sel, pod_labels(obj)), f"{path}: {obj['metadata']['name']} selector misses its pods"


def test_every_service_selects_a_workload():
    workloads = [d for d in all_objects() if d["kind"] in WORKLOADS]
    for path, svc in manifests():
        if svc["kind"] != "Service":
            continue
        sel = svc["spec"].get("selector")
        assert sel, f"{path}: Service {svc['metadata']['name']} has no selector"
        targets = [w for w in workloads if matches(sel, pod_labels(w))]
        assert targets, f"{path}: Service {svc['metadata']['name']} selects no workload ({sel})"
        for w in targets:  # named target ports exist on the pods
            ports = {p.get("name") for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort")
                if isinstance(target, str):
                    assert target in ports, f"{path}: {svc['metadata']['name']} targetPort {target} not on the pods"


def test_network_policies_select_workloads_and_let_clients_in():
    objects = all_objects()
    workloads = [d for d in objects if d["kind"] in WORKLOADS]
    for path, pol in manifests():
        if pol["kind"] != "NetworkPolicy":
            continue
        sel = pol["spec"]["podSelector"]["matchLabels"]
        assert any(matches(sel, pod_labels(w)) for w in workloads), f"{path}: {pol['metadata']['name']} selects nothing"
        for rule in pol["spec"]["ingress"]:
            for peer in rule["from"]:
                peer_sel = peer["podSelector"]["matchLabels"]
                allowed = [w for w in workloads if matches(peer_sel, pod_labels(w))]
                names = {w.get("metadata", {}).get("name") or w["metadata"].get("generateName") for w in allowed}
                kinds = {w["kind"] for w in allowed}
                assert "Deployment" in kinds, f"{path}: the router is not let in ({names})"
                assert any("{{" in str(n) for n in names), f"{path}: flow-run pods (work pool template) are not let in"


def test_statefulsets_and_jobs_name_their_headless_services():
    services = {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == "Service"}
    for path, obj in manifests():
        name = None
        if obj["kind"] == "StatefulSet":
            name = obj["spec"]["serviceName"]
        elif obj["kind"] == "Job":
            name = pod_spec(obj).get("subdomain")
        if name is None:
            continue
        assert name in services, f"{path}: {obj['metadata']['name']} names Service {name}, which does not exist"
        svc = services[name]
        assert svc["spec"].get("clusterIP") == "None", f"{path}: Service {name} must be headless"
        assert matches(svc["spec"]["selector"], pod_labels(obj)), f"{path}: Service {name} does not select its pods"


def test_service_accounts_claims_and_configmaps_exist():
    objs = all_objects()
    names = {(d["kind"], d["metadata"].get("name")) for d in objs}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    names |= {("ConfigMap", g["name"]) for g in kust.get("configMapGenerator", [])}
    for obj in objs:
        if obj["kind"] in WORKLOADS:
            spec = pod_spec(obj)
            if "serviceAccountName" in spec and "{{" not in spec["serviceAccountName"]:
                assert ("ServiceAccount", spec["serviceAccountName"]) in names, spec["serviceAccountName"]
        if obj["kind"] == "RoleBinding":
            assert ("Role", obj["roleRef"]["name"]) in names
            for s in obj["subjects"]:
                assert ("ServiceAccount", s["name"]) in names
        for _, key, value in walk(obj):
            if key == "persistentVolumeClaim":
                assert ("PersistentVolumeClaim", value["claimName"]) in names, value["claimName"]
            if key == "configMapRef":
                assert ("ConfigMap", value["name"]) in names, value["name"]


# --- rollout: SGLang engines behind sglang-router per region ------------------------------------------------


def regions() -> list[Path]:
    return sorted(p for p in (K8S / "rollout").iterdir() if p.is_dir())


def router_py_flags() -> set[str]:
    from sluiceway.infra.router import SGLangRouter

    router = SGLangRouter("/nonexistent", circuit_breaker=False)  # builds a command; starts nothing
    try:
        return set(flags(router._command(30000, 29000)))
    finally:
        router.close()


# Kubernetes-only flags of sglang-router 0.3.2: the router finds engine pods by label instead of POST /workers.
SERVICE_DISCOVERY_FLAGS = {
    "--service-discovery",
    "--selector",
    "--service-discovery-port",
    "--service-discovery-namespace",
}


@pytest.mark.parametrize("region", regions(), ids=lambda p: p.name)
def test_router_flags_are_ours_and_parse(region: Path):
    from sglang_router.launch_router import parse_router_args

    docs = [d for f in region.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d]
    router = next(d for d in docs if d["kind"] == "Deployment")
    engines = next(d for d in docs if d["kind"] == "StatefulSet")
    c = container(router)
    assert c["command"][-2:] == ["-m", "sglang_router.launch_router"]
    args = c["args"]
    ours = router_py_flags()
    unknown = set(flags(args)) - ours - SERVICE_DISCOVERY_FLAGS
    assert not unknown, f"router flags that infra/router.py does not use: {sorted(unknown)}"
    # What infra/router.py decided on (infra/router.py's docstring says why) holds here too.
    for flag in ("--policy", "--health-check-interval-secs", "--health-failure-threshold", "--retry-max-retries",
                 "--request-timeout-secs", "--disable-circuit-breaker", "--prometheus-port"):  # fmt: skip
        assert flag in args, f"router without {flag}"
    from sluiceway.infra.router import POLICIES

    assert arg_value(args, "--policy") in POLICIES
    parsed = parse_router_args(args)  # sglang-router 0.3.2's own argparse: SystemExit on a bad flag or value
    parsed._validate_router_args()
    # Inside the cluster the router listens on the pod's address; the Service keeps it in the cluster.
    assert parsed.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert parsed.port == ports["http"] and parsed.prometheus_port == ports["metrics"]
    # Service discovery finds exactly this region's engine pods, on their port, in our namespace.
    assert parsed.service_discovery
    assert parsed.selector == engines["spec"]["selector"]["matchLabels"]
    assert matches(parsed.selector, pod_labels(engines))
    engine_ports = {p["name"]: p["containerPort"] for p in container(engines)["ports"]}
    assert parsed.service_discovery_port == engine_ports["http"]
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert parsed.service_discovery_namespace == namespace
    rules = next(d for d in docs if d["kind"] == "Role")["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)


@pytest.mark.parametrize("region", regions(), ids=lambda p: p.name)
def test_engines_run_sglang_with_the_launchers_flags(region: Path):
    from sluiceway.infra.sglang_launcher import sglang_server_command

    docs = [d for f in region.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d]
    engines = next(d for d in docs if d["kind"] == "StatefulSet")
    c = container(engines)
    assert c["command"] == ["python", "-m", "sglang.launch_server"]
    args = c["args"]
    launcher = set(flags(sglang_server_command("m", "h", 1, tp_size=8, dtype="bfloat16", seed=1)))
    extra = set(flags(args)) - launcher
    # Flags beyond the launcher's, each checked against SGLang's server arguments (they reach engines that
    # sluiceway starts through --sglang-X too).
    assert extra <= {"--mem-fraction-static", "--served-model-name", "--context-length"}, extra
    assert arg_value(args, "--host") == "0.0.0.0"
    assert int(arg_value(args, "--port")) == {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert int(arg_value(args, "--tp-size")) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert arg_value(args, "--model-path").startswith("/runs/") and "/runs" in mounts
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    region_label = engines["spec"]["selector"]["matchLabels"]["sluiceway.io/region"]
    assert region_label == region.name


# --- the trainer as a multi-node torchrun job ----------------------------------------------------------------


def test_trainer_job_is_a_consistent_torchrun_group():
    from torch.distributed.run import get_args_parser

    job = the("Job", "trainer")
    c = container(job)
    assert c["command"] == ["torchrun"]
    args = get_args_parser().parse_args(c["args"])  # torch's own parser: SystemExit on a bad flag
    assert args.rdzv_backend == "c10d" and args.module
    assert args.training_script == "sluiceway.tasks.train.worker"
    assert importlib.util.find_spec(args.training_script) is not None
    nodes = int(args.nnodes)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes > 1
    assert int(args.nproc_per_node) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    # The rendezvous is hosted by pod 0: Indexed Job pods are named JOB-INDEX under their subdomain.
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{pod_spec(job)['subdomain']}"
    assert int(port) in {p["containerPort"] for p in c["ports"]}
    # The variables tasks/train/worker.py reads, the authkey from a Secret.
    worker_src = (ROOT / "tasks" / "train" / "worker.py").read_text()
    env = {e["name"]: e for e in c["env"]}
    for name in ("SLUICEWAY_TRAINER_INIT", "SLUICEWAY_TRAINER_CONTROL", "SLUICEWAY_TRAINER_AUTHKEY"):
        assert name in env and name in worker_src, name
    assert "secretKeyRef" in env["SLUICEWAY_TRAINER_AUTHKEY"]["valueFrom"]
    control_port = int(env["SLUICEWAY_TRAINER_CONTROL"]["value"].rsplit(":", 1)[1])
    assert control_port in {p["containerPort"] for p in c["ports"]}


# --- the Prefect work pool ------------------------------------------------------------------------------------


def render_template(job_variables: dict) -> dict:
    """What a Kubernetes worker makes of the template for a deployment with these job variables: Prefect's
    own templating over the variables' defaults, then the worker's env handling (the deployment's env is
    prepended to a hard-coded env list: prefect_kubernetes.worker._populate_env_in_manifest)."""
    from prefect.utilities.templating import apply_values

    template = base_job_template()
    variables = {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}
    variables.update(job_variables)
    config = apply_values(template["job_configuration"], variables)
    c = config["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert isinstance(c["env"], list), "the template's env should be a list of secretKeyRefs"
    deployment_env = [{"name": k, "value": v} for k, v in (config.get("env") or {}).items()]
    c["env"] = deployment_env + [e for e in c["env"] if e["name"] not in (config.get("env") or {})]
    return config


def serve_pool_job_variables() -> dict:
    """The job variables `sluiceway serve --pool` registers (flows/deploy.py build_deployments)."""
    from sluiceway.flows.deploy import FLOW_RUN_ENV

    return {"working_dir": "/runs", "env": dict(FLOW_RUN_ENV)}


def test_work_pool_template_accepts_serve_pool_job_variables():
    from prefect.utilities.schema_tools import validate

    schema = base_job_template()["variables"]
    errors = validate(serve_pool_job_variables(), schema, preprocess=True, ignore_required=True)
    assert not errors, errors
    errors = validate({"gpus": -1}, schema, preprocess=True, ignore_required=True)
    assert errors, "a negative GPU count should not validate"


def test_work_pool_template_renders_a_flow_run_job():
    config = render_template(serve_pool_job_variables())
    manifest = config["job_manifest"]
    assert manifest["apiVersion"] == "batch/v1" and manifest["kind"] == "Job"
    spec = manifest["spec"]["template"]["spec"]
    # What the Kubernetes worker requires of a job manifest (its _get_base_job_manifest).
    assert spec["restartPolicy"] == "Never" and spec["parallelism"] == 1 and spec["completions"] == 1
    c = spec["containers"][0]
    assert c["name"] == "prefect-job"
    assert c["image"] == base_job_template()["variables"]["properties"]["image"]["default"]
    assert "{{" not in json.dumps(manifest), "a placeholder was left unrendered"
    env = {e["name"]: e for e in c["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], name
    assert env["HF_HUB_OFFLINE"]["value"] == "1"  # the deployment's env reaches the pod
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/runs", "/dev/shm"}
    # A credential set as a job variable would be stored in Prefect's database: the template takes none.
    props = base_job_template()["variables"]["properties"]
    assert not [k for k in props if SECRET_NAME.search(k)], "a work pool variable for a credential"


def test_work_pool_template_with_the_kubernetes_worker():
    """With prefect-kubernetes installed (it is in the worker image, not a sluiceway dependency), its own
    job configuration accepts the rendered template."""
    if importlib.util.find_spec("prefect_kubernetes") is None:
        pytest.skip("prefect-kubernetes is not installed (pip install prefect-kubernetes to run this check)")
    import asyncio

    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(base_job_template(), serve_pool_job_variables())
    )
    assert config.job_manifest["spec"]["template"]["spec"]["containers"][0]["name"] == "prefect-job"
