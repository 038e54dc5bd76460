"""The shipped deployment (deploy/): configs that tools accept, files that exist, commands whose
flags exist, and generated Kubernetes manifests in sync with dashboards/."""

import functools
import glob
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
ITERSCOPE_IMAGE = "iterscope"


def load_generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", DEPLOY / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).is_file():
        pytest.fail("promtool not found: install it with `make prometheus`")
    return path


@functools.cache
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def k8s_documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    documents = []
    for resource in kustomization["resources"]:
        documents += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return documents


def k8s_object(kind: str, name: str) -> dict:
    matches = [d for d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def flag_value(argv: list[str], flag: str) -> str:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in an argument list."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


# --- Prometheus ------------------------------------------------------------------------------


def shipped_rule_groups() -> list[dict]:
    groups = []
    for path in sorted((REPO / "dashboards" / "alerts").glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    assert groups, "dashboards/alerts/*.yml: no rule groups exist"
    return groups


def rule_file_patterns(config_path: Path) -> list[str]:
    config = yaml.safe_load(config_path.read_text())
    return [str(config_path.parent / pattern) for pattern in config["rule_files"]]


@pytest.mark.live
def test_promtool_accepts_the_prometheus_config():
    result = subprocess.run(
        [promtool(), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_loads_the_generated_rules_of_every_alert_file():
    """Each rule_files pattern matches files, together exactly the generated rules file (an
    empty match would load no alerts without any error from Prometheus), which holds every
    group of dashboards/alerts/*.yml."""
    loaded = set()
    for pattern in rule_file_patterns(PROMETHEUS_CONFIG):
        matches = {Path(p).resolve() for p in glob.glob(pattern)}
        assert matches, f"rule_files pattern {pattern} matches no file"
        loaded |= matches
    rules_file = DEPLOY / "prometheus" / "rules" / "iterscope.yml"
    assert loaded == {rules_file.resolve()}
    names = [g["name"] for g in yaml.safe_load(rules_file.read_text())["groups"]]
    assert names == [g["name"] for g in shipped_rule_groups()]


def test_prometheus_scrapes_the_sidecar_and_sends_to_alertmanager():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    services = compose()["services"]
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    for target in targets:
        host, _ = target.rsplit(":", 1)
        assert host == "localhost" or host in services, f"scrape target {target}: no such service"
    metrics_port = flag_value(services["sidecar"]["command"], "--metrics-port")
    assert f"sidecar:{metrics_port}" in targets
    alertmanagers = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert alertmanagers == ["alertmanager:9093"] and "alertmanager" in services


def test_alertmanager_routes_only_to_defined_receivers():
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    receivers = {receiver["name"] for receiver in config["receivers"]}
    routes = [config["route"], *config["route"].get("routes", [])]
    for route in routes:
        assert route.get("receiver", config["route"]["receiver"]) in receivers


def test_alertmanager_groups_and_inhibits_per_engine_of_each_instance():
    """Replica pods each run engine 0: grouping by engine alone would merge their pages."""
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    assert {"alertname", "instance", "engine"} <= set(config["route"]["group_by"])
    for rule in config["inhibit_rules"]:
        assert {"instance", "engine"} <= set(rule["equal"])


def test_alertmanager_inhibit_rules_name_shipped_alerts():
    """An inhibit rule naming an alert that does not exist (renamed, misspelt) silently
    inhibits nothing."""
    config = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    shipped = {
        rule["alert"]
        for group in shipped_rule_groups()
        for rule in group["rules"]
        if "alert" in rule
    }
    for rule in config["inhibit_rules"]:
        matchers = rule["source_matchers"] + rule["target_matchers"]
        named = {name for m in matchers for name in re.findall(r'^alertname!?="(\w+)"$', m)}
        assert named and named <= shipped, named - shipped


# --- docker compose --------------------------------------------------------------------------


def bind_mounts(service: dict) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of the service's bind mounts (named volumes excluded)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE_FILE.parent / source).resolve(), PurePosixPath(target)))
    return mounts


def host_path(service_name: str, container_path: str) -> Path:
    """Where a path seen inside the container comes from on the host (through bind mounts)."""
    path = PurePosixPath(container_path)
    for source, target in sorted(
        bind_mounts(compose()["services"][service_name]),
        key=lambda mount: len(mount[1].parts),
        reverse=True,
    ):
        if path == target or target in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not mounted into service {service_name}")


def test_compose_bind_mounts_build_context_and_named_volumes_exist():
    spec = compose()
    declared_volumes = set(spec.get("volumes") or {})
    for name, service in spec["services"].items():
        assert "image" in service or "build" in service, name
        for source, _ in bind_mounts(service):
            assert source.exists(), f"service {name} mounts missing {source}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared_volumes, f"service {name}: undeclared volume {source}"
        for dependency in service.get("depends_on", []):
            assert dependency in spec["services"], f"{name} depends on unknown {dependency}"
        if "build" in service:
            context = (COMPOSE_FILE.parent / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]) == DOCKERFILE
            assert service["build"]["args"]["VARIANT"] in ("cpu", "cuda")


def test_compose_services_load_the_shipped_configs():
    services = compose()["services"]
    prometheus_config = host_path(
        "prometheus", flag_value(services["prometheus"]["command"], "--config.file")
    )
    assert prometheus_config == PROMETHEUS_CONFIG
    # The rule_files patterns, resolved inside the container, reach the generated rules.
    container_config = PurePosixPath(flag_value(services["prometheus"]["command"], "--config.file"))
    for pattern in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]:
        container_pattern = str(container_config.parent / pattern)
        resolved = PurePosixPath(*_normalise(PurePosixPath(container_pattern).parts))
        host_pattern = host_path("prometheus", str(resolved.parent)) / resolved.name
        assert glob.glob(str(host_pattern)), f"{container_pattern} matches nothing in the container"
    alertmanager = host_path(
        "alertmanager", flag_value(services["alertmanager"]["command"], "--config.file")
    )
    assert alertmanager == DEPLOY / "alertmanager" / "alertmanager.yml"
    collector = host_path(
        "otel-collector", flag_value(services["otel-collector"]["command"], "--config")
    )
    assert collector == DEPLOY / "otel" / "collector.yml"


def _normalise(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part == "..":
            out.pop()
        elif part != ".":
            out.append(part)
    return out


def test_grafana_provisions_prometheus_and_every_dashboard():
    services = compose()["services"]
    provisioning = host_path("grafana", "/etc/grafana/provisioning")
    datasources = yaml.safe_load((provisioning / "datasources" / "datasources.yml").read_text())
    by_type = {source["type"]: source for source in datasources["datasources"]}
    assert by_type["prometheus"]["isDefault"] is True
    for source in datasources["datasources"]:
        host = re.match(r"https?://([^:/]+)", source["url"]).group(1)
        assert host in services, f"data source {source['name']}: no service {host}"
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yml").read_text())
    dashboards_dir = host_path("grafana", providers["providers"][0]["options"]["path"])
    shipped = sorted((REPO / "dashboards" / "json").glob("*.json"))
    assert shipped, "dashboards/json/*.json: no dashboards exist"
    assert sorted(dashboards_dir.glob("*.json")) == shipped
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path("grafana", home).is_file()


def test_collector_exports_traces_to_a_service_of_the_stack():
    config = yaml.safe_load((DEPLOY / "otel" / "collector.yml").read_text())
    services = compose()["services"]
    pipeline = config["service"]["pipelines"]["traces"]
    for exporter in pipeline["exporters"]:
        host = config["exporters"][exporter]["endpoint"].split(":")[0]
        assert host in services
    endpoint = services["sidecar"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert re.match(r"http://otel-collector:4317$", endpoint)
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


def test_engine_and_sidecar_share_the_ipc_socket_volume():
    services = compose()["services"]
    server_address = flag_value(services["server"]["command"], "--telemetry-address")
    sidecar_address = flag_value(services["sidecar"]["command"], "--address")
    assert server_address == sidecar_address and server_address.startswith("ipc://")
    socket_dir = str(PurePosixPath(server_address[len("ipc://") :]).parent)
    for name in ("server", "sidecar"):
        assert any(v.split(":")[1] == socket_dir for v in services[name]["volumes"]), name


def test_compose_publishes_ports_on_loopback_only():
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


# --- Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_copies_existing_files_and_has_cpu_default_and_cuda_variant():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert {"torch-cpu", "torch-cuda"} <= stages
    assert re.search(r"^FROM torch-\$\{VARIANT\}", text, re.M)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: missing"
            assert re.search(rf"^!{re.escape(source)}", ignore, re.M), f"{source} is ignored"


# --- Kubernetes ------------------------------------------------------------------------------


def test_kustomization_resources_exist_and_are_kubernetes_objects():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    for document in k8s_documents():
        assert document["apiVersion"] and document["kind"] and document["metadata"]["name"]


def test_pod_runs_engine_and_sidecar_sharing_an_emptydir_for_the_socket():
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    engine, sidecar = containers["engine"], containers["sidecar"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    address = flag_value(engine["args"], "--telemetry-address")
    assert address == flag_value(sidecar["args"], "--address") and address.startswith("ipc://")
    socket_dir = str(PurePosixPath(address[len("ipc://") :]).parent)
    for container in (engine, sidecar):
        mounts = [m for m in container["volumeMounts"] if m["mountPath"] == socket_dir]
        assert len(mounts) == 1, container["name"]
        assert "emptyDir" in volumes[mounts[0]["name"]]


def test_podmonitor_and_service_reach_the_sidecar_metrics_port():
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "sidecar")
    assert ports["metrics"] == int(flag_value(sidecar["args"], "--metrics-port"))
    assert ports["http"] == int(flag_value(pod["spec"]["containers"][0]["args"], "--port"))
    monitor = k8s_object("PodMonitor", "iterscope")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"]
    api_monitor = k8s_object("PodMonitor", "iterscope-api")["spec"]
    assert api_monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [e["port"] for e in api_monitor["podMetricsEndpoints"]] == ["http"]
    service = k8s_object("Service", "iterscope")["spec"]
    assert service["selector"].items() <= pod_labels.items()
    for port in service["ports"]:
        assert port["targetPort"] in ports


def test_network_policy_admits_only_clients_to_the_api_and_prometheus_to_metrics():
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]
    policy = k8s_object("NetworkPolicy", "iterscope")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    container_ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    admitted = admitted_peers(policy)
    assert set(admitted) == {"http", "metrics"} == container_ports
    clients = {"podSelector": {"matchLabels": {"iterscope-client": "true"}}}
    (prometheus,) = admitted["metrics"]
    assert prometheus["namespaceSelector"] and prometheus["podSelector"]
    assert sorted(admitted["http"], key=str) == sorted([clients, prometheus], key=str)


def admitted_peers(policy: dict) -> dict[str, list[dict]]:
    """Port name -> every peer an ingress rule admits to it."""
    admitted: dict[str, list[dict]] = {}
    for rule in policy["ingress"]:
        assert rule["from"], "a rule without 'from' admits every peer"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    return admitted


def test_the_api_key_comes_from_an_optional_secret():
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    (variable,) = [v for v in engine["env"] if v["name"] == "ITERSCOPE_API_KEY"]
    secret = variable["valueFrom"]["secretKeyRef"]
    assert secret == {"name": "iterscope-api-key", "key": "key", "optional": True}


@pytest.mark.parametrize("name", ["iterscope", "iterscope-api"])
def test_podmonitor_sets_instance_to_the_pod_name(name):
    """Pages and legends read "<pod> engine 0" rather than a pod IP that changes on restart;
    the API's job names the same pod, so IterscopeHTTPErrors names it too."""
    (endpoint,) = k8s_object("PodMonitor", name)["spec"]["podMetricsEndpoints"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_name"],
        "targetLabel": "instance",
        "action": "replace",
    } in endpoint["relabelings"]


# --- every rule's series is scraped ----------------------------------------------------------

# What a PromQL expression holds besides metric names: label matchers, range and subquery
# windows, strings; label lists of by/without/on/ignoring/group_left/group_right; keywords.
PROMQL_SKIPPED = re.compile(r'\{[^}]*\}|\[[^\]]*\]|"(?:[^"\\]|\\.)*"')
PROMQL_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}
PROMQL_NAME = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions and aggregations left out)."""
    text = PROMQL_LABEL_LIST.sub(" ", PROMQL_SKIPPED.sub(" ", expr))
    return {
        m.group(1)
        for m in PROMQL_NAME.finditer(text)
        if not m.group(2) and m.group(1).lower() not in PROMQL_KEYWORDS
    }


def test_series_names_reads_metrics_only():
    expr = (
        'sum by (instance) (rate(http_requests_total{status="5xx"}[5m])) / '
        "sum by (instance) (rate(http_requests_total[5m])) > "
        "scalar(iterscope:alert_threshold:http_5xx_ratio) and on (instance, job) "
        "max_over_time(iterscope_sidecar_up[1d]) == 1 unless up offset 5m"
    )
    assert series_names(expr) == {
        "http_requests_total",
        "iterscope:alert_threshold:http_5xx_ratio",
        "iterscope_sidecar_up",
        "up",
    }


def sidecar_series() -> set[str]:
    sys.path.insert(0, str(REPO))  # dashboards/ is not an installed package
    from dashboards.metric_names import SERIES_NAMES

    return set(SERIES_NAMES)


def api_series(server_args: list[str]) -> set[str]:
    """What the API server's /metrics serves: its HTTP series, and the sidecar's series only
    when it is given the sidecar's URL."""
    from engine.entrypoints.api_metrics import HttpSeries

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    names = {
        family.name + suffix
        for family in HttpSeries().registry.collect()
        for suffix in suffixes[family.type]
    }
    passes_sidecar = any(arg.startswith("--sidecar-metrics-url") for arg in server_args)
    return names | (sidecar_series() if passes_sidecar else set())


def rules_reading_unscraped_series(scraped: set[str]) -> list[str]:
    """'Rule: names' for every rule of dashboards/alerts that reads a series no scrape brings
    (up comes from every scrape, recorded names from the rules)."""
    rules = [rule for group in shipped_rule_groups() for rule in group["rules"]]
    available = scraped | {"up"} | {rule["record"] for rule in rules if "record" in rule}
    missing = []
    for rule in rules:
        unscraped = series_names(str(rule["expr"])) - available
        if unscraped:
            missing.append(f"{rule.get('alert') or rule['record']}: {sorted(unscraped)}")
    return missing


def test_every_alert_reads_series_the_k8s_podmonitors_scrape():
    """Each port a PodMonitor scrapes serves its series (the sidecar's port the engine series,
    the API port the HTTP series); every rule must read only series some scrape brings, so
    IterscopeHTTPErrors has data on Kubernetes. Prometheus must be let in on each such port,
    and each port is its own job, so the series both serve (iterscope_sidecar_up) never mix."""
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    served = {"metrics": sidecar_series(), "http": api_series(engine["args"])}
    pod_labels = pod["metadata"]["labels"].items()
    monitors = [
        d
        for d in k8s_documents()
        if d["kind"] == "PodMonitor" and d["spec"]["selector"]["matchLabels"].items() <= pod_labels
    ]
    jobs_by_port = {
        e["port"]: m["metadata"]["name"] for m in monitors for e in m["spec"]["podMetricsEndpoints"]
    }
    assert len(set(jobs_by_port.values())) == len(jobs_by_port) == len(monitors)
    assert not rules_reading_unscraped_series(set().union(*(served[port] for port in jobs_by_port)))
    assert rules_reading_unscraped_series(served["metrics"]), "the check cannot fail"
    admitted = admitted_peers(k8s_object("NetworkPolicy", "iterscope")["spec"])
    prometheus = admitted["metrics"]
    for port in jobs_by_port:
        assert all(peer in admitted[port] for peer in prometheus), port


def test_every_alert_reads_series_the_compose_prometheus_scrapes():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    services = compose()["services"]
    server, sidecar = services["server"]["command"], services["sidecar"]["command"]
    served = {
        f"server:{flag_value(server, '--port')}": api_series(server),
        f"sidecar:{flag_value(sidecar, '--metrics-port')}": sidecar_series(),
    }
    jobs_by_target = {
        target: job["job_name"]
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
        if target in served
    }
    assert len(set(jobs_by_target.values())) == len(jobs_by_target) == len(served)
    assert not rules_reading_unscraped_series(
        set().union(*(served[target] for target in jobs_by_target))
    )


# --- generated manifests ---------------------------------------------------------------------


def test_generated_manifests_are_in_sync_with_dashboards():
    generator = load_generator()
    stale = generator.stale_files(generator.render())
    assert not stale, f"stale {stale}: run `python deploy/generate.py` and commit the result"


def test_prometheus_rule_holds_the_groups_of_the_compose_rules():
    rule = k8s_object("PrometheusRule", "iterscope-alerts")
    rules_file = DEPLOY / "prometheus" / "rules" / "iterscope.yml"
    assert rule["spec"]["groups"] == yaml.safe_load(rules_file.read_text())["groups"]


def test_shipped_alerting_config_keeps_the_rules_defaults():
    """deploy/alerting.yml as checked in states the defaults: the generated rules are the
    rules of dashboards/alerts unchanged (what the promtool tests test)."""
    rules_file = DEPLOY / "prometheus" / "rules" / "iterscope.yml"
    assert yaml.safe_load(rules_file.read_text())["groups"] == shipped_rule_groups()


def alerting_config(base: str, **thresholds: float) -> dict:
    defaults = {
        "ttft_p99_seconds": 2,
        "inter_token_latency_p99_seconds": 0.2,
        "http_5xx_ratio": 0.05,
    }
    return {"runbook_base_url": base, "thresholds": {**defaults, **thresholds}}


def test_generator_sets_runbook_base_and_thresholds_of_the_config():
    generator = load_generator()
    base = "https://wiki.example.com/ops/iterscope/"
    groups = generator.apply_alerting(
        shipped_rule_groups(), alerting_config(base, ttft_p99_seconds=0.75)
    )
    rules = [rule for group in groups for rule in group["rules"]]
    alerts = [rule for rule in rules if "alert" in rule]
    assert alerts
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        assert url == f"https://wiki.example.com/ops/iterscope/{alert['alert']}.md"
        assert (REPO / "docs" / "runbooks" / url.rsplit("/", 1)[1]).is_file()
    thresholds = {
        r["record"]: r["expr"]
        for r in rules
        if r.get("record", "").startswith("iterscope:alert_threshold:")
    }
    assert thresholds == {
        "iterscope:alert_threshold:ttft_p99_seconds": "vector(0.75)",
        "iterscope:alert_threshold:inter_token_latency_p99_seconds": "vector(0.2)",
        "iterscope:alert_threshold:http_5xx_ratio": "vector(0.05)",
    }


@pytest.mark.live
def test_alerts_fire_on_the_threshold_the_generator_writes(tmp_path):
    """With the 5xx threshold raised from 5% to 20%, the promtool tests of latency.yml (pods
    answering 10% errors fire at the default) fail for IterscopeHTTPErrors alone: the alert
    reads the threshold the generator wrote, and Prometheus accepts what it wrote."""
    generator = load_generator()
    config = alerting_config(generator.load_alerting()["runbook_base_url"], http_5xx_ratio=0.2)
    groups = generator.apply_alerting(shipped_rule_groups(), config)
    (tmp_path / "latency.yml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests").mkdir()
    unit_tests = REPO / "dashboards" / "alerts" / "tests" / "latency_test.yml"
    shutil.copy(unit_tests, tmp_path / "tests" / unit_tests.name)
    result = subprocess.run(
        [promtool(), "test", "rules", unit_tests.name],
        cwd=tmp_path / "tests",
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "alertname: IterscopeHTTPErrors" in output, output
    assert "IterscopeTTFTHigh" not in output and "IterscopeInterTokenLatencyHigh" not in output


def test_generator_refuses_a_wrong_alerting_config():
    generator = load_generator()
    groups = shipped_rule_groups()
    with pytest.raises(ValueError, match="not an absolute"):
        generator.apply_alerting(groups, alerting_config("docs/runbooks"))
    with pytest.raises(ValueError, match=r"not in the rules: \['ttft_p99_second'\]"):
        generator.apply_alerting(groups, alerting_config("https://x.org", ttft_p99_second=1))
    config = alerting_config("https://x.org")
    del config["thresholds"]["http_5xx_ratio"]
    with pytest.raises(ValueError, match=r"not set: \['http_5xx_ratio'\]"):
        generator.apply_alerting(groups, config)


def test_a_configmap_holds_each_dashboard_verbatim():
    configmaps = [
        d
        for d in k8s_documents()
        if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard")
    ]
    data = {name: text for c in configmaps for name, text in c["data"].items()}
    shipped = {p.name: p.read_text() for p in (REPO / "dashboards" / "json").glob("*.json")}
    assert shipped, "dashboards/json/*.json: no dashboards exist"
    assert data == shipped


def test_generator_refuses_duplicate_groups_and_non_rule_files(tmp_path):
    generator = load_generator()
    group = "groups:\n  - name: same\n    rules: []\n"
    (tmp_path / "a.yml").write_text(group)
    (tmp_path / "b.yml").write_text(group)
    with pytest.raises(ValueError, match="'same' is in both a.yml and b.yml"):
        generator.rule_groups(tmp_path)
    (tmp_path / "b.yml").write_text("rule_files: []\n")
    with pytest.raises(ValueError, match="not a Prometheus rules file"):
        generator.rule_groups(tmp_path)
    with pytest.raises(ValueError, match="no dashboards"):
        generator.dashboard_configmaps(tmp_path)


def test_generator_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    generator = load_generator()
    monkeypatch.setattr(generator, "DEPLOY_DIR", tmp_path)
    assert generator.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "stale: deploy/k8s/generated/prometheusrule.yaml" in out
    assert "stale: deploy/prometheus/rules/iterscope.yml" in out
    assert generator.main([]) == 0
    assert generator.main(["--check"]) == 0


# --- iterscope commands ----------------------------------------------------------------------


def iterscope_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every iterscope command line the deployment runs."""
    commands = []
    for name, service in compose()["services"].items():
        if service.get("image", "").split(":")[0] == ITERSCOPE_IMAGE:
            commands.append((f"compose {name}", service["command"]))
    pod = k8s_object("Deployment", "iterscope")["spec"]["template"]["spec"]
    for container in pod["containers"]:
        commands.append((f"k8s {container['name']}", container["args"]))
    cmd = re.search(r"^CMD (\[.*\])$", DOCKERFILE.read_text(), re.M).group(1)
    commands.append(("Dockerfile CMD", yaml.safe_load(cmd)))
    return commands


@functools.cache
def subcommand_help(subcommand: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.live
@pytest.mark.parametrize("subcommand", ["serve", "sidecar"])
def test_every_flag_the_deployment_passes_exists(subcommand):
    uses = [(where, argv) for where, argv in iterscope_commands() if argv[0] == subcommand]
    assert uses
    help_text = subcommand_help(subcommand)
    for where, argv in uses:
        for flag in (a.split("=")[0] for a in argv[1:] if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), (
                f"{where}: `iterscope {subcommand}` has no {flag}"
            )
