"""Serving profiles, launcher commands and their validation, the tiny model, `up`'s policy (no servers)."""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import importlib.util
import json
import struct
import sys
import time
from pathlib import Path

import pytest
import yaml

from serving import profile as profiles
from serving import tiny_model, up
from serving.launcher import LaunchError, build_commands, check, split_cores, validate

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def _cpu_data() -> dict:
    return yaml.safe_load(Path(profiles.__file__).with_name("cpu.yaml").read_text())


def _gpu_data() -> dict:
    return yaml.safe_load(Path(profiles.__file__).with_name("gpu.yaml").read_text())


def test_builtin_profiles_load() -> None:
    cpu, gpu = profiles.load("cpu"), profiles.load("gpu")
    assert cpu.platform == "cpu" and cpu.uses_tiny_model()
    assert cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cpu.deployments.fast.speculative is not None and cpu.deployments.fast.speculative.method == "ngram"
    assert cpu.deployments.hq.speculative is None
    assert gpu.deployments.hq.dtype == "bfloat16" and gpu.deployments.hq.quantization is None
    assert gpu.deployments.fast.quantization == "fp8"
    assert gpu.deployments.hq.share + gpu.deployments.fast.share < 0.95
    assert gpu.deployments.hq.share > gpu.deployments.fast.share
    assert all(dep.prefix_caching for _, dep in gpu.deployments.items())
    assert gpu.start == "sequential"


def _problems(data: dict) -> str:
    with pytest.raises(profiles.ProfileError) as caught:
        profiles.parse(yaml.safe_dump(data), "p.yaml")
    return str(caught.value)


def test_profile_error_names_field_and_value() -> None:
    data = _cpu_data()
    data["deployments"]["hq"]["port"] = 70000
    assert (
        "p.yaml: deployments.hq.port: Input should be less than or equal to 65535 (value: 70000)"
        in _problems(data)
    )


def test_profile_error_names_unknown_field() -> None:
    data = _cpu_data()
    data["deployments"]["fast"]["speculatve"] = data["deployments"]["fast"].pop("speculative")
    assert "deployments.fast.speculatve: Extra inputs are not permitted" in _problems(data)


def test_profile_error_names_bad_speculative_method() -> None:
    data = _cpu_data()
    data["deployments"]["fast"]["speculative"]["method"] = "eagle"
    message = _problems(data)
    assert "deployments.fast.speculative" in message and "method eagle needs a model" in message


def test_gpu_memory_split_must_stay_below_ceiling() -> None:
    data = _gpu_data()
    data["deployments"]["fast"]["share"] = 0.40
    message = _problems(data)
    assert "deployments.hq.share + deployments.fast.share = 0.55 + 0.4 = 0.95 must be below 0.95" in message


def test_profile_rejects_shared_served_model_name() -> None:
    data = _cpu_data()
    data["deployments"]["fast"]["served_model"] = "tiny-hq"
    assert "both 'tiny-hq'" in _problems(data)


def test_profile_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(profiles.ProfileError, match=r"nope\.yaml: cannot read"):
        profiles.load(tmp_path / "nope.yaml")


def test_cpu_commands_are_exact() -> None:
    commands = build_commands(
        profiles.load("cpu"), model_dir="/m", ports={"hq": 9001, "fast": 9002}, python="py", cores=[0, 1]
    )
    hq, fast = commands["hq"], commands["fast"]
    assert hq.argv == [
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "tiny-hq",
        "--host", "127.0.0.1", "--port", "9001", "--dtype", "bfloat16", "--max-model-len", "2048",
        "--enable-prefix-caching",
    ]  # fmt: skip
    assert fast.argv[-2:] == [
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}',
    ]
    assert hq.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert fast.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert (hq.url, fast.url) == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")


def test_gpu_commands_split_memory_and_quantize_fast() -> None:
    commands = build_commands(profiles.load("gpu"), host="0.0.0.0", python="py")
    hq, fast = commands["hq"].engine_args, commands["fast"].engine_args
    assert hq[hq.index("--gpu-memory-utilization") + 1] == "0.55"
    assert fast[fast.index("--gpu-memory-utilization") + 1] == "0.38"
    assert fast[fast.index("--quantization") + 1] == "fp8" and "--quantization" not in hq
    assert json.loads(fast[fast.index("--speculative-config") + 1])["method"] == "ngram"
    assert commands["hq"].port == 8001 and commands["hq"].url == "http://127.0.0.1:8001"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in commands["hq"].env


def test_tiny_model_needs_a_directory() -> None:
    with pytest.raises(LaunchError, match=r"deployments\.hq\.model is 'tiny'"):
        build_commands(profiles.load("cpu"))


@pytest.mark.parametrize(
    ("shares", "cores", "expected"),
    [
        ([0.5, 0.5], [0, 1], [[0], [1]]),
        ([0.5, 0.5], [4, 5, 6, 7], [[4, 5], [6, 7]]),
        ([0.75, 0.25], [0, 1, 2, 3, 4, 5, 6, 7], [[0, 1, 2, 3, 4, 5], [6, 7]]),
        ([0.9, 0.1], [0, 1], [[0], [1]]),
        ([0.5, 0.5], [3], [[3], [3]]),
    ],
)
def test_split_cores(shares: list[float], cores: list[int], expected: list[list[int]]) -> None:
    assert split_cores(shares, cores) == expected


@needs_vllm
def test_vllm_parser_accepts_profiles_and_names_typos() -> None:
    cpu = build_commands(profiles.load("cpu"), model_dir="/m", python=sys.executable)
    gpu = build_commands(profiles.load("gpu"), python=sys.executable)
    typo = dataclasses.replace(cpu["fast"], engine_args=(*cpu["fast"].engine_args, "--enable-prefix-cachng"))
    choice = dataclasses.replace(cpu["hq"], engine_args=(*cpu["hq"].engine_args, "--dtype", "bfloat17"))
    spec = dataclasses.replace(
        cpu["hq"],
        engine_args=(*cpu["hq"].engine_args, "--speculative-config", '{"method":"ngram","lookup":3}'),
    )
    started = time.monotonic()
    # One batch: importing vLLM's parser costs ~20 s on this machine.
    problems = check(
        {f"cpu-{n}": c for n, c in cpu.items()}
        | {f"gpu-{n}": c for n, c in gpu.items()}
        | {"typo": typo, "choice": choice, "spec": spec}
    )
    print(f"vLLM argument check took {time.monotonic() - started:.1f} s")
    assert problems == {
        "typo": ["unknown vLLM argument --enable-prefix-cachng (did you mean --enable-prefix-caching?)"],
        "choice": [
            "argument --dtype: invalid choice: 'bfloat17' "
            "(choose from 'auto', 'bfloat16', 'float', 'float16', 'float32', 'half')"
        ],
        "spec": ["--speculative-config: unknown key 'lookup'"],
    }


def test_validate_raises_naming_deployment_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import launcher

    monkeypatch.setattr(
        launcher, "check", lambda commands, timeout_s=0: {"fast": ["unknown vLLM argument --x"]}
    )
    with pytest.raises(LaunchError, match=r"^fast: unknown vLLM argument --x$"):
        validate({})


def test_tiny_model_builds_deterministically_and_fast(tmp_path: Path) -> None:
    started = time.monotonic()
    first = tiny_model.build(tmp_path / "a")
    elapsed = time.monotonic() - started
    second = tiny_model.build(tmp_path / "b")
    assert elapsed < 10, f"building the tiny model took {elapsed:.1f} s"
    assert first.name == second.name
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)  # fmt: skip
    _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
    assert not mismatch and not errors
    again = time.monotonic()
    assert tiny_model.build(tmp_path / "a") == first
    assert time.monotonic() - again < 1.0  # a cache hit does not rebuild


def test_tiny_model_shape_and_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = tiny_model.build(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        128,
        2,
        1,
    )
    assert config["head_dim"] == 64 and config["num_hidden_layers"] == 2
    header = _safetensors_header(folder / "model.safetensors")
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [64, 128]
    assert header["lm_head.weight"]["shape"] == [config["vocab_size"], 128]
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    text = "def add(a, b):\n    return a + b  # héllo"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as data:
        (length,) = struct.unpack("<Q", data.read(8))
        return json.loads(data.read(length))


def test_up_registers_its_flags() -> None:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    args = parser.parse_args(
        ["up", "--profile", "gpu", "--policy", "p.yaml", "--port", "9000", "--host", "0.0.0.0"]
    )
    assert (args.profile, args.policy, args.port, args.host, args.func) == (
        "gpu",
        "p.yaml",
        9000,
        "0.0.0.0",
        up.run,
    )


def test_up_policy_points_at_the_started_servers(tmp_path: Path) -> None:
    from gateway.policy import model as gateway_policy

    commands = build_commands(profiles.load("cpu"), model_dir="/m", ports={"hq": 9101, "fast": 9102})
    written = up.write_policy(None, commands, tmp_path / "policy.yaml")
    policy = gateway_policy.load(written)
    assert policy.deployments["hq"].url == "http://127.0.0.1:9101"
    assert policy.deployments["fast"].served_model == "tiny-fast"
    assert policy.deployments["fast"].max_model_len == 2048
    assert policy.deployments["fast"].load.spill_to == "hq"  # the template's other settings survive


def test_up_policy_without_template_is_valid() -> None:
    from gateway.policy import model as gateway_policy

    commands = build_commands(profiles.load("cpu"), model_dir="/m", ports={"hq": 9101, "fast": 9102})
    policy = gateway_policy.Policy.model_validate(up.fill_policy({}, commands))
    assert policy.default == "fast" and policy.fallback == ["fast", "hq"]


def test_up_reports_a_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    data = _cpu_data()
    data["deployments"]["hq"]["dtype"] = "bf16"
    bad.write_text(yaml.safe_dump(data))
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    assert up.run(parser.parse_args(["up", "--profile", str(bad)])) == 2
    err = capsys.readouterr().err
    assert "deployments.hq.dtype" in err and "'bf16'" in err and "Traceback" not in err


def test_serving_commands_prints_what_deploy_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from serving.__main__ import main

    assert main(["commands", "gpu", "--host", "0.0.0.0", "--python", "python3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = build_commands(profiles.load("gpu"), host="0.0.0.0", python="python3")
    assert printed == ["# hq", expected["hq"].shell(), "# fast", expected["fast"].shell()]
