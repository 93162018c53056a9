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
    # One family: both members of the tiny family, and tool calls parsed on both deployments of each profile.
    assert (cpu.deployments.hq.model, cpu.deployments.fast.model) == ("tiny:large", "tiny:small")
    assert {dep.tool_call_parser for profile in (cpu, gpu) for _, dep in profile.deployments.items()} == {"hermes"}
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


def test_profile_rejects_unknown_tiny_member() -> None:
    data = _cpu_data()
    data["deployments"]["hq"]["model"] = "tiny:huge"
    assert "deployments.hq: model 'tiny:huge': the tiny family has tiny:small, tiny:large" in _problems(data)


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
        "py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/large", "--served-model-name",
        "tiny-hq", "--host", "127.0.0.1", "--port", "9001", "--dtype", "bfloat16", "--max-model-len", "32768",
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    ]  # fmt: skip
    assert fast.argv[4] == "/m/small"
    assert fast.argv[-5:-3] == [
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
    with pytest.raises(LaunchError, match=r"deployments\.hq\.model is 'tiny:large'"):
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
    parser = dataclasses.replace(cpu["hq"], engine_args=(*cpu["hq"].engine_args, "--tool-call-parser", "hermez"))
    started = time.monotonic()
    # One batch: importing vLLM's parser costs ~20 s on this machine.
    problems = check(
        {f"cpu-{n}": c for n, c in cpu.items()}
        | {f"gpu-{n}": c for n, c in gpu.items()}
        | {"typo": typo, "choice": choice, "spec": spec, "parser": parser}
    )
    print(f"vLLM argument check took {time.monotonic() - started:.1f} s")
    # The tool-call parser's name is checked as the server checks it before loading.
    assert problems.pop("parser")[0].startswith("invalid tool call parser: hermez (chose from {")
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


def test_tiny_model_builds_deterministically_and_once(tmp_path: Path) -> None:
    """Its build time is reported by `up`, not asserted here (a loaded machine doubles it): what matters is that
    two builds are the same bytes and that a built family is reused, not rebuilt."""
    first = tiny_model.build(tmp_path / "a")
    second = tiny_model.build(tmp_path / "b")
    assert first.name == second.name
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for member in profiles.TINY_MEMBERS:
        _, mismatch, errors = filecmp.cmpfiles(first / member, second / member, files, shallow=False)
        assert not mismatch and not errors, member
    # One family: the members share the tokenizer and chat template byte for byte.
    _, mismatch, errors = filecmp.cmpfiles(first / "small", first / "large", tiny_model.TOKENIZER_FILES, shallow=False)
    assert not mismatch and not errors
    written = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}
    assert tiny_model.build(tmp_path / "a") == first
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == written  # a cache hit writes nothing


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize(("member", "hidden", "heads", "kv_heads", "layers"),
                         [("small", 128, 2, 1, 2), ("large", 512, 8, 2, 8)])  # fmt: skip
def test_tiny_model_shape(family: Path, member: str, hidden: int, heads: int, kv_heads: int, layers: int) -> None:
    config = json.loads((family / member / "config.json").read_text())
    shape = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"])
    assert shape == (hidden, heads, kv_heads) and config["num_hidden_layers"] == layers
    assert config["head_dim"] == 64  # vLLM's CPU attention rejects 16
    header = _safetensors_header(family / member / "model.safetensors")
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [64 * kv_heads, hidden]
    assert header["lm_head.weight"]["shape"] == [config["vocab_size"], hidden]
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"BF16"}


def test_tiny_tokenizer_keeps_text_and_tool_tags(family: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(family / "small" / "tokenizer.json"))
    config = json.loads((family / "small" / "config.json").read_text())
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    text = "def add(a, b):\n    return a + b  # héllo"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    # vLLM's hermes parser reads the tags from decoded text: one token each, not dropped as special.
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tokenizer.encode(call).ids
    assert ids[0] == tokenizer.token_to_id("<tool_call>") and ids[-1] == tokenizer.token_to_id("</tool_call>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == call


def test_tiny_chat_template_renders_tool_turns_as_hermes(family: Path) -> None:
    transformers = pytest.importorskip("transformers")

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(family / "small"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 18}'},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_large_member_computes_what_the_small_one_does(family: Path) -> None:
    """hq and fast mean the same thing by the same request: the large member is the small network widened."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(family / "small"))
    ids = torch.tensor([tokenizer("<|im_start|>user\nSay something about the old stone bridge.")["input_ids"]])
    logits = {}
    for member in profiles.TINY_MEMBERS:
        model = transformers.LlamaForCausalLM.from_pretrained(str(family / member), torch_dtype=torch.float32)
        with torch.no_grad():
            logits[member] = model(ids).logits[0]
    assert torch.allclose(logits["small"], logits["large"], atol=1e-4)
    assert torch.equal(logits["small"].argmax(-1), logits["large"].argmax(-1))


def test_tiny_members_draw_from_a_1024_token_vocabulary_that_holds_the_end_token(family: Path) -> None:
    """The tokenizer is large so that prompts count close to cl100k; what random weights draw stays the first
    1,024 ids and the tool tags, so answers end (the end token is one draw in ~1,000) and hold byte tokens that
    end inside a character (the resume tests cut there)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(family / "small"))
    ids = torch.tensor([tokenizer("<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n")
                        ["input_ids"]])
    tags = [tokenizer.convert_tokens_to_ids(tag) for tag in tiny_model.TOOL_TAGS]
    drawn = torch.zeros(len(tokenizer), dtype=torch.bool)
    drawn[: tiny_model.TinyModelSpec().drawn_vocab_size] = True
    drawn[tags] = True
    assert len(tokenizer) > 4 * drawn.sum()  # the confinement is what this test is about
    for member in profiles.TINY_MEMBERS:
        model = transformers.LlamaForCausalLM.from_pretrained(str(family / member), torch_dtype=torch.float32)
        with torch.no_grad():
            logits = model(ids).logits[0, :, : len(tokenizer)]
        assert logits[:, ~drawn].max() < logits[:, drawn].min() - 20
        end = logits.softmax(-1)[:, tokenizer.convert_tokens_to_ids("<|im_end|>")]
        assert ((end > 1 / 3000) & (end < 1 / 300)).all(), end


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
    assert policy.deployments["fast"].max_model_len == 32768
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
