"""docs/deploy.md's "Inference pools that come and go" stays true: its Kubernetes YAML parses, the pools template
becomes a file `sluiceway pools up` accepts once the pod's `sh -c` has filled in the pod's name and address, the
pieces agree with each other (labels, ports, the grace period against drain_timeout_s, the S3 Secret), and the
run's `sluiceway serve` command parses with the CLI's own parser into a run that reads the pools' registry."""

import re
import shlex
import subprocess

import yaml
from paths import ROOT

from sluiceway.flows.cli import make_parser, resolve_config
from sluiceway.flows.pools import load_pools

DOC = ROOT / "docs" / "deploy.md"
POD_NAME, POD_IP = "sluiceway-pool-east-7c9d8f6b5-x2k4q", "10.12.3.45"


def section() -> str:
    text = DOC.read_text()
    start = text.index("### Inference pools that come and go")
    return text[start : text.index("\n### ", start + 1)]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), re.S)


def manifests() -> dict[str, dict]:
    (block,) = blocks("yaml")
    return {doc["kind"]: doc for doc in yaml.safe_load_all(block)}


def container(docs: dict) -> dict:
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def filled_in(docs: dict, tmp_path):
    """Run the container's `sh -c` up to `pools up`, on this machine's paths, and load what it wrote."""
    c = container(docs)
    assert c["command"] == ["sh", "-c"]
    (script,) = c["args"]
    prepare, _, start = script.partition("&&")
    assert start.strip().startswith("exec sluiceway pools up "), "pools up must be PID 1 to get the SIGTERM"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "pools.yaml.in").write_text(docs["ConfigMap"]["data"]["pools.yaml.in"])
    prepare = prepare.replace(mounts["template"], str(tmp_path / "etc")).replace(mounts["work"], str(tmp_path))
    env = {"POD_NAME": POD_NAME, "POD_IP": POD_IP, "PATH": "/usr/bin:/bin"}  # what the downward API sets
    subprocess.run(["sh", "-c", prepare], check=True, env=env)
    path = start.split()[start.split().index("up") + 1].replace(mounts["work"], str(tmp_path))
    return load_pools(path)


def test_the_yaml_parses_and_the_filled_in_template_is_a_pools_file(tmp_path):
    docs = manifests()
    assert set(docs) == {"ConfigMap", "Deployment", "NetworkPolicy"}
    yaml.safe_load(docs["ConfigMap"]["data"]["pools.yaml.in"])  # the template is YAML before it is filled in too
    (pool,) = filled_in(docs, tmp_path).pools
    assert pool.name == POD_NAME
    assert pool.host == "0.0.0.0"
    assert pool.url == f"http://{POD_IP}:{pool.router_port}"


def test_the_pieces_agree(tmp_path):
    docs = manifests()
    (pool,) = filled_in(docs, tmp_path).pools
    dep, c = docs["Deployment"], container(docs)
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["containerPort"] for p in c["ports"]] == [pool.router_port]
    assert [p["port"] for p in docs["NetworkPolicy"]["spec"]["ingress"][0]["ports"]] == [pool.router_port]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pool.drain_timeout_s  # else the pod dies mid-drain
    env = {e["name"]: e.get("valueFrom", e.get("value")) for e in c["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the Secret that "Apply" creates, never a value
        assert env[key] == {"secretKeyRef": {"name": "sluiceway-s3", "key": key}}
    (endpoint,) = c["envFrom"]
    assert f"name: {endpoint['configMapRef']['name']}" in (ROOT / "infra/k8s/storage/s3-endpoint.yaml").read_text()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["template"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]


def test_the_run_reads_the_pools_registry(tmp_path):
    (pool,) = filled_in(manifests(), tmp_path).pools
    (block,) = blocks("bash")
    command = re.match(r"(?:.*\\\n)*.*", block).group().replace("\\\n", " ")  # the first command, continued lines
    argv = shlex.split(command)
    assert argv[0] == "sluiceway"
    cfg = resolve_config(make_parser().parse_args(argv[1:]))
    assert cfg.pool_registry_uris == [pool.weights_uri]  # the run reads the registry the pools write
    assert not cfg.has_own_engines and cfg.sync.update_weight_mode == "delta"
