"""A tiny, servable Llama-architecture model built locally in seconds (random weights, local tokenizer)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

# Bump when the build changes in a way the content hash cannot see (e.g. tensor naming).
BUILD_VERSION = 1
DEFAULT_CACHE_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agent-gateway/tiny-model"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_DONE_MARKER = ".complete"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the model; CPU attention in vLLM rejects head_dim 16, so heads stay at 64 wide."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    tokenizer_vocab_size: int = 1024
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def read_corpus() -> list[str]:
    """Return the shipped training texts in a stable order."""
    folder = resources.files("serving") / "corpus"
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".txt"))
    return [(folder / name).read_text(encoding="utf-8") for name in names]


def content_hash(spec: TinyModelSpec, corpus: list[str]) -> str:
    """Hash of everything that determines the model directory's content."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"build": BUILD_VERSION, **asdict(spec)}, sort_keys=True).encode())
    for text in corpus:
        digest.update(hashlib.sha256(text.encode()).digest())
    digest.update(CHAT_TEMPLATE.encode())
    return digest.hexdigest()[:16]


def build(cache_dir: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Return a servable model directory, building it under cache_dir unless an identical one exists."""
    spec = spec or TinyModelSpec()
    corpus = read_corpus()
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = root / content_hash(spec, corpus)
    if (target / _DONE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it private; servers in other users' containers read it
    try:
        write_model(staging, spec, corpus)
        (staging / _DONE_MARKER).write_text("ok\n")
        try:
            staging.rename(target)
        except OSError:
            # A concurrent build won the race; its result is byte-identical.
            if not (target / _DONE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_model(folder: Path, spec: TinyModelSpec, corpus: list[str]) -> None:
    """Write tokenizer, config and weights of the tiny model into folder."""
    vocab = train_tokenizer(folder, spec, corpus)
    # Padding the embedding table to a multiple of 64 keeps the matmul shapes friendly.
    vocab_size = -(-vocab["size"] // 64) * 64
    write_json(folder / "config.json", model_config(spec, vocab_size, vocab))
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"],
        },
    )
    write_safetensors(folder / "model.safetensors", random_weights(spec, vocab_size))


def train_tokenizer(folder: Path, spec: TinyModelSpec, corpus: list[str]) -> dict[str, int]:
    """Train a byte-level BPE tokenizer on the corpus; return its size and special-token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tokenizer_vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "model_max_length": spec.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, f"{token} missing from the trained vocabulary"
        ids[token] = token_id
    return {"size": tokenizer.get_vocab_size(), **ids}


def model_config(spec: TinyModelSpec, vocab_size: int, vocab: dict[str, int]) -> dict[str, object]:
    """The Hugging Face config.json of a LlamaForCausalLM with the spec's shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": vocab["<|endoftext|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "torch_dtype": "bfloat16",
    }


def random_weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, np.ndarray]:
    """Seeded normal(0, 0.02) weights in Hugging Face Llama tensor names, as float32."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    hidden, inter, head = spec.hidden_size, spec.intermediate_size, spec.head_dim
    kv = spec.num_key_value_heads * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (spec.num_attention_heads * head, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, spec.num_attention_heads * head),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["lm_head.weight"] = (vocab_size, hidden)
    tensors = {name: rng.normal(0.0, 0.02, size=shape).astype(np.float32) for name, shape in shapes.items()}
    for layer in range(spec.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = np.ones(hidden, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write float32 arrays as a bf16 safetensors file (numpy has no bf16, so round the bits by hand)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        bits = np.ascontiguousarray(tensors[name], dtype=np.float32).view(np.uint32)
        # Round to nearest even on the 16 bits that bf16 drops.
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        blob = rounded.tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format wants the data 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for blob in blobs:
            out.write(blob)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.tiny_model [DIR]`: build (or find) the model and print its directory."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("cache_dir", nargs="?", default=None, help=f"default {DEFAULT_CACHE_DIR}")
    args = parser.parse_args(argv)
    print(build(args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
