"""Policy files: every shipped file loads, errors are located (file, line, field, value), schema in sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.command import main
from gateway.policy import model as policy

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILES = sorted((ROOT / "policies").glob("*.yaml"))


def test_there_are_policy_files() -> None:
    assert any(p.name == "default.yaml" for p in POLICY_FILES)


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.name)
def test_every_shipped_policy_loads(path: Path) -> None:
    loaded = policy.load(path)
    assert {"auto", "hq", "fast"} <= set(loaded.models)


def test_json_schema_file_is_current() -> None:
    assert (ROOT / "policies" / "policy.schema.json").read_text() == policy.json_schema(), (
        "regenerate with: agent-gateway policy schema > policies/policy.schema.json")


BASE = (ROOT / "policies" / "default.yaml").read_text()


def _problems(text: str) -> list[str]:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse(text, "p.yaml")
    return caught.value.problems


def test_unknown_field_is_named_with_its_line() -> None:
    text = BASE.replace("    max_in_flight: 256\n", "    max_in_flight: 256\n    max_inflight: 3\n", 1)
    line = text.splitlines().index("    max_inflight: 3") + 1
    (problem,) = _problems(text)
    assert problem.startswith(f"p.yaml:{line}: deployments.hq.max_inflight: Extra inputs are not permitted")
    assert "(value: 3)" in problem


def test_every_problem_is_reported_at_once() -> None:
    text = BASE.replace("max_in_flight: 256", "max_in_flight: -1").replace("cooldown_s: 10", "cooldown_s: soon", 1)
    problems = _problems(text)
    assert len(problems) == 2
    assert any("deployments.hq.max_in_flight" in p and "(value: -1)" in p for p in problems)
    assert any("deployments.hq.health.cooldown_s" in p and "'soon'" in p for p in problems)


def test_dangling_deployment_reference_is_named() -> None:
    (problem,) = _problems(BASE.replace("    use: hq\n", "    use: hq-v9\n", 1))
    assert "rules[0].use: unknown deployment 'hq-v9'" in problem


def test_bad_yaml_names_the_line() -> None:
    (problem,) = _problems("version: 1\ndeployments:\n  hq: [unclosed\n")
    assert problem.startswith("p.yaml:") and "not valid YAML" in problem


def test_non_mapping_is_rejected() -> None:
    assert "must be a YAML mapping" in _problems("- just\n- a list\n")[0]


def test_cli_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(BASE)
    bad.write_text(BASE.replace("default: fast", "default: fastest"))
    assert main(["policy", "validate", str(good)]) == 0
    assert main(["policy", "validate", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "default: unknown deployment 'fastest'" in err


def test_cli_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml: cannot read" in capsys.readouterr().err


def test_cli_explain_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "req.json"
    request.write_text('{"model": "auto", "messages": [{"role": "user", "content": "hi"}],'
                       ' "tools": [{"type": "function", "function": {"name": "f"}}]}')
    assert main(["policy", "explain", "--policy", str(ROOT / "policies/default.yaml"),
                 "--request", str(request)]) == 0
    out = capsys.readouterr().out
    assert "deployment: hq" in out and "rule: planning-to-hq" in out
    assert main(["policy", "explain", "--policy", str(ROOT / "policies/default.yaml"), "--request", str(request),
                 "--load", "hq:healthy=0"]) == 0
    out = capsys.readouterr().out
    assert "deployment: fast" in out and "skip hq: unhealthy" in out


def test_cli_explain_bad_request_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "req.json"
    request.write_text("{broken")
    assert main(["policy", "explain", "--policy", str(ROOT / "policies/default.yaml"),
                 "--request", str(request)]) == 2
    assert "req.json: The request body is not valid JSON" in capsys.readouterr().err


def test_version_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("agent-gateway ")


def test_target_hq_share_starts_from_the_calibrated_threshold(tmp_path: Path) -> None:
    from gateway.classifier.scoring import Calibration

    loaded = policy.load(ROOT / "policies" / "complexity-share.yaml")
    rule = next(r for r in loaded.rules if r.name == "top-30-percent-to-hq")
    share = rule.when.complexity
    assert isinstance(share, policy.ComplexityShare)
    assert share.threshold == pytest.approx(Calibration.default().threshold_for_share(0.3))
    assert 0 < share.threshold < 1
    assert loaded.share_windows == {0.3: 1000} and loaded.share_cold_thresholds == {0.3: share.threshold}
    given = policy.parse((ROOT / "policies" / "complexity-share.yaml").read_text().replace(
        "{hq_share: 0.3}", "{hq_share: 0.3, window: 400, threshold: 0.5}"))
    assert given.share_windows == {0.3: 400} and given.share_cold_thresholds == {0.3: 0.5}


def test_missing_calibration_file_is_located(tmp_path: Path) -> None:
    text = (ROOT / "policies" / "complexity-share.yaml").read_text().replace(
        "{hq_share: 0.3}", "{hq_share: 0.3, calibration: nope.json}")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(policy.PolicyError) as caught:
        policy.load(path)
    (problem,) = caught.value.problems
    line = text.splitlines().index("    when: {complexity: {hq_share: 0.3, calibration: nope.json}}") + 1
    assert problem.startswith(f"{path}:{line}: rules[1].when.complexity") and "nope.json" in problem


def _constant_model(path: Path, logit: float) -> Path:
    """A classifier artifact whose score is sigmoid(logit) for every request."""
    from gateway.classifier.scoring import Classifier
    from gateway.classifier.vocabulary import CharNgrams

    Classifier(CharNgrams(ngram_min=4, ngram_max=4), {}, [], logit).save(path)
    return path


def test_a_policy_and_its_candidates_name_their_own_classifier_loaded_once(tmp_path: Path) -> None:
    _constant_model(tmp_path / "live.json", -3.0)
    (tmp_path / "models").mkdir()
    _constant_model(tmp_path / "models" / "learned.json", 3.0)
    text = BASE + "classifier: live.json\npolicies:\n  learned: {classifier: models/learned.json}\n  same: {}\n"
    path = tmp_path / "p.yaml"
    path.write_text(text)
    loaded = policy.load(path)
    assert loaded.classifier is not None and loaded.classifier.path == str(tmp_path / "live.json")
    learned, same = loaded.candidate_policy("learned"), loaded.candidate_policy("same")
    assert learned.classifier is not None and learned.classifier.model.intercept == 3.0
    assert same.classifier is loaded.classifier  # a candidate without one reads the live model, not a copy
    assert learned.classifier_or(None) is learned.classifier.model  # type: ignore[arg-type]
    assert policy.parse(BASE).classifier_or(None) is None  # type: ignore[arg-type]  # the process's model
    assert json.loads(loaded.model_dump_json())["classifier"] == str(tmp_path / "live.json")


def test_a_classifier_file_that_is_not_a_model_is_located(tmp_path: Path) -> None:
    (tmp_path / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    text = BASE + "policies:\n  learned:\n    classifier: model.pkl\n"
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(policy.PolicyError) as caught:
        policy.load(path)
    (problem,) = caught.value.problems
    line = text.splitlines().index("    classifier: model.pkl") + 1
    assert problem.startswith(f"{path}:{line}: policies.learned.classifier: ") and "looks like a pickle" in problem


def test_labels_name_declared_deployments() -> None:
    (problem,) = _problems(BASE + "labels:\n  strong: hq\n  judge: {deployment: judge-9}\n")
    assert "labels.judge.deployment: unknown deployment 'judge-9'" in problem
    (problem,) = _problems(BASE + "labels:\n  strong: hq\n  weak: hq\n")
    assert "labels.weak: 'hq' is also the strong deployment" in problem
    assert policy.parse(BASE + "labels: {strong: hq, judge: {deployment: hq, rate_per_min: 10}}\n").labels


def test_failover_order_leaves_out_deployments_only_experiments_reach() -> None:
    judge = BASE.replace("\n  fast:\n", "\n  judge:\n    url: http://127.0.0.1:9\n    served_model: j\n  fast:\n", 1)
    spare = policy.parse(judge, "p.yaml")  # declared, reached by nothing: a spare, still tried last
    assert spare.failover_order("fast")[-1] == "judge" and spare.experiment_only == frozenset()
    judged = policy.parse(judge + "labels: {strong: hq, judge: {deployment: judge}}\n", "p.yaml")
    assert judged.experiment_only == {"judge"} and "judge" not in judged.failover_order("fast")
    assert judged.failover_order("judge")[0] == "judge"  # its own calls (the labeller's) still go to it
    named = policy.parse(judge.replace("fallback: [", "fallback: [judge, ", 1)
                         + "labels: {strong: hq, judge: {deployment: judge}}\n", "p.yaml")
    assert "judge" in named.failover_order("fast")  # the operator said so


def test_a_cached_input_token_costs_a_tenth_of_an_input_token_unless_priced() -> None:
    default = policy.Price(input_per_mtok_usd=3.0, output_per_mtok_usd=15.0)
    # 10,000 prompt tokens of which 9,000 cached, 100 out: 1,000 new, 9,000 at 0.30, 100 at 15
    cost = default.cost_usd(10_000, 100, cached_tokens=9_000)
    assert cost == pytest.approx((1_000 * 3 + 9_000 * 0.3 + 100 * 15) / 1e6)
    assert default.cost_usd(10_000, 100, cached_tokens=0) == pytest.approx((10_000 * 3 + 100 * 15) / 1e6)
    priced = policy.Price(input_per_mtok_usd=3.0, output_per_mtok_usd=15.0, cached_input_per_mtok_usd=0.05)
    cost = priced.cost_usd(10_000, 100, cached_tokens=9_000)
    assert cost == pytest.approx((1_000 * 3 + 9_000 * 0.05 + 100 * 15) / 1e6)
    free = policy.Price(input_per_mtok_usd=3.0, cached_input_fraction=0.0)
    assert free.cost_usd(10_000, 0, cached_tokens=10_000) == 0.0
    # a cached count is never more than the prompt, nor negative, whoever passes it
    assert default.cost_usd(100, 0, cached_tokens=500) == default.cost_usd(100, 0, cached_tokens=100)
    assert default.cost_usd(100, 0, cached_tokens=-5) == default.cost_usd(100, 0, cached_tokens=0)


def test_the_cached_price_is_read_from_the_policy_file() -> None:
    text = BASE.replace("price: {input_per_mtok_usd: 3.0, output_per_mtok_usd: 15.0}",
                        "price: {input_per_mtok_usd: 3.0, output_per_mtok_usd: 15.0, cached_input_per_mtok_usd: 0.3}")
    text = text.replace("price: {input_per_mtok_usd: 0.5, output_per_mtok_usd: 1.5}",
                        "price: {input_per_mtok_usd: 0.5, output_per_mtok_usd: 1.5, cached_input_fraction: 0.5}")
    loaded = policy.parse(text)
    assert loaded.deployments["hq"].price.cached_per_mtok_usd == 0.3
    assert loaded.deployments["fast"].price.cached_per_mtok_usd == 0.25


@pytest.mark.parametrize(("price", "needle"), [
    ("cached_input_per_mtok_usd: -1", "deployments.hq.price.cached_input_per_mtok_usd: Input should be greater "
                                      "than or equal to 0 (value: -1)"),
    ("cached_input_fraction: 1.5", "deployments.hq.price.cached_input_fraction: Input should be less than or "
                                   "equal to 1 (value: 1.5)"),
    ("cached_input_fraction: lots", "deployments.hq.price.cached_input_fraction: Input should be a valid number"),
    ("cached_input_per_mtok_usd: 4", "deployments.hq.price: cached_input_per_mtok_usd 4.0 is above "
                                     "input_per_mtok_usd 3.0"),
    ("cached_input_per_mtok_usd: 0.3, cached_input_fraction: 0.1",
     "deployments.hq.price: give cached_input_per_mtok_usd or cached_input_fraction, not both"),
])
def test_a_bad_cached_price_is_named_with_its_file_line_and_value(price: str, needle: str) -> None:
    text = BASE.replace("price: {input_per_mtok_usd: 3.0, output_per_mtok_usd: 15.0}",
                        "price: {input_per_mtok_usd: 3.0, output_per_mtok_usd: 15.0, " + price + "}")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if price in row)
    (problem,) = _problems(text)
    assert problem.startswith(f"p.yaml:{line}: ") and needle in problem, problem


def test_the_schema_offers_the_cached_price() -> None:
    schema = json.loads(policy.json_schema())["$defs"]["Price"]["properties"]
    assert schema["cached_input_fraction"]["default"] == 0.1 and schema["cached_input_fraction"]["maximum"] == 1
    assert "cached_input_per_mtok_usd" in schema
