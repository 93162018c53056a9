"""A tiny, servable Llama family built locally in seconds: one tokenizer and chat template, two sizes."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from serving.profile import TINY_MEMBERS

# Bump when the build changes in a way the content hash cannot see (e.g. tensor naming).
BUILD_VERSION = 4
DEFAULT_CACHE_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agent-gateway/tiny-model"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Hermes tool-calling tags, one token each as in Qwen2.5, and not special, so decoded text keeps them
# (vLLM's hermes parser reads them from the text).
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHAT_TEMPLATE = (resources.files("serving") / "chat_template.jinja").read_text(encoding="utf-8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_DONE_MARKER = ".complete"
RMS_NORM_EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    """One member's size; CPU attention in vLLM rejects head_dim 16, so heads stay 64 wide."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TinyModelSpec:
    """The family's shapes: the large member is the small one's network inside a 4x wider, 4x deeper one."""

    small: Shape = Shape(128, 256, 2, 2, 1)
    # ~25M parameters: per token about 50x the small member's matrix work (see widen()).
    large: Shape = Shape(512, 1536, 8, 8, 2)
    # A coding agent's first request is 10-20k tokens (Claude Code's system prompt and tools alone ~19k).
    max_position_embeddings: int = 32768
    # Trained on the shipped corpus and ~2 MB of Python's standard library (code, and English in pydoc's topics):
    # up to 24,576 entries (21,436 trained) count ~1.2 tokens per cl100k token of agent text (python -m
    # serving.tokenizer_ratio), where 1,024 on the shipped corpus alone counted ~2.0. 3 MB of text gains little.
    tokenizer_vocab_size: int = 24576
    stdlib_corpus_chars: int = 2_000_000
    # What the random weights draw from: the first ids a 1,024-entry tokenizer would have had (the specials, the
    # bytes, the most frequent merges) and the tool tags; the rest of the vocabulary only counts prompts. Drawing
    # from all of them made the end token ~21x rarer (answers ran to their cap), and so the byte tokens that end
    # inside a character, which the resume tests cut at.
    drawn_vocab_size: int = 1024
    seed: int = 0
    # What vLLM generates for a call that names no output limit (Codex names none): random weights rarely stop
    # by themselves, and filling a 32k window takes minutes on CPU. Only a default: a call's max_tokens wins.
    default_max_new_tokens: int = 512


def read_corpus(stdlib_chars: int = TinyModelSpec.stdlib_corpus_chars) -> list[str]:
    """Return the training texts in a stable order: the shipped ones, then the standard library's."""
    folder = resources.files("serving") / "corpus"
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".txt"))
    return [(folder / name).read_text(encoding="utf-8") for name in names] + stdlib_texts(stdlib_chars)


def stdlib_texts(max_chars: int) -> list[str]:
    """About `max_chars` of this Python's standard library: pydoc's topics (the reference manual's English), then
    modules in name order. Local text only (no model hub, no network); the same Python gives the same texts, and
    the content hash covers them, so another Python's build lands in its own directory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in [root / "pydoc_data" / "topics.py", *sorted(root.glob("*.py"))]:
        if total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # a stripped Python: train on what there is
            continue
        texts.append(text)
        total += len(text)
    return texts


def content_hash(spec: TinyModelSpec, corpus: list[str]) -> str:
    """Hash of everything that determines the model directory's content."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"build": BUILD_VERSION, **asdict(spec)}, sort_keys=True).encode())
    for text in corpus:
        digest.update(hashlib.sha256(text.encode()).digest())
    digest.update(CHAT_TEMPLATE.encode())
    return digest.hexdigest()[:16]


def build(cache_dir: str | Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Return the family's directory (one servable model directory per member), built under cache_dir
    unless an identical one exists."""
    spec = spec or TinyModelSpec()
    corpus = read_corpus(spec.stdlib_corpus_chars)
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = root / content_hash(spec, corpus)
    if (target / _DONE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it private; servers in other users' containers read it
    try:
        write_family(staging, spec, corpus)
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


def write_family(folder: Path, spec: TinyModelSpec, corpus: list[str]) -> None:
    """Write each member's directory: the same tokenizer files, its config, its weights."""
    small, large = (folder / member for member in TINY_MEMBERS)
    small.mkdir()
    large.mkdir()
    vocab = train_tokenizer(small, spec, corpus)
    for name in TOKENIZER_FILES:
        shutil.copyfile(small / name, large / name)
    # Padding the embedding table to a multiple of 64 keeps the matmul shapes friendly.
    vocab_size = -(-vocab["size"] // 64) * 64
    weights = random_weights(spec.small, vocab_size, spec.seed)
    drawn = np.zeros(vocab_size, dtype=bool)
    drawn[: spec.drawn_vocab_size] = True
    drawn[[vocab[tag] for tag in TOOL_TAGS]] = True
    confine_generation(weights, drawn)
    write_member(small, spec, spec.small, vocab, weights)
    write_member(large, spec, spec.large, vocab, widen(weights, spec.small, spec.large, spec.seed + 1))


def rms_norm_eps(spec: TinyModelSpec, shape: Shape) -> float:
    """The small member's epsilon, scaled like the mean square it is added to (see widen())."""
    return RMS_NORM_EPS * spec.small.hidden_size / shape.hidden_size


def write_member(folder: Path, spec: TinyModelSpec, shape: Shape, vocab: dict[str, int],
                 weights: dict[str, np.ndarray]) -> None:
    vocab_size = weights["lm_head.weight"].shape[0]
    write_json(folder / "config.json", model_config(spec, shape, vocab_size, vocab))
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": vocab["<|endoftext|>"],
            "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"],
            "max_new_tokens": spec.default_max_new_tokens,
        },
    )
    write_safetensors(folder / "model.safetensors", weights)


def train_tokenizer(folder: Path, spec: TinyModelSpec, corpus: list[str]) -> dict[str, int]:
    """Train a byte-level BPE tokenizer on the corpus; return its size and special-token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
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
    for token in (*SPECIAL_TOKENS, *TOOL_TAGS):
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, f"{token} missing from the trained vocabulary"
        ids[token] = token_id
    return {"size": tokenizer.get_vocab_size(), **ids}


def model_config(
    spec: TinyModelSpec, shape: Shape, vocab_size: int, vocab: dict[str, int]
) -> dict[str, object]:
    """The Hugging Face config.json of a LlamaForCausalLM of the given shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": rms_norm_eps(spec, shape),
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": vocab["<|endoftext|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "torch_dtype": "bfloat16",
    }


def random_weights(shape: Shape, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded normal(0, 0.02) matrices and unit norms in Hugging Face Llama tensor names, as float32."""
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = {}
    for name, dims in tensor_shapes(shape, vocab_size).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(dims, dtype=np.float32)
        else:
            tensors[name] = rng.normal(0.0, 0.02, size=dims).astype(np.float32)
    return tensors


# The residual stream's dimension that carries a constant: every embedding holds LANE_VALUE there, no layer
# reads or writes it, so after the final norm it is a positive number at every position, and lm_head's weights
# on it act as a per-token bias (Llama has none). LANE_VALUE is ~5x an embedding entry: large enough that the
# lane stays well above zero after the norm, small enough to change the other dimensions' scale by a few percent.
CONSTANT_LANE = 0
LANE_VALUE = 0.1
# Weight on the lane of a token never to draw: after the final norm the lane is about 2 (LANE_VALUE over the
# residual's root mean square), so its logit drops by ~40, which no random logit (spread ~0.3) makes up.
NEVER_DRAWN = -20.0


def confine_generation(weights: dict[str, np.ndarray], drawn: np.ndarray) -> None:
    """Make the network draw only the tokens `drawn` marks, in place, leaving the rest of its computation as is."""
    weights["model.embed_tokens.weight"][:, CONSTANT_LANE] = LANE_VALUE
    readers = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    for name, array in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            array[CONSTANT_LANE, :] = 0.0
        elif name.endswith(readers):
            array[:, CONSTANT_LANE] = 0.0
    weights["lm_head.weight"][:, CONSTANT_LANE] = np.where(drawn, 0.0, NEVER_DRAWN)


def tensor_shapes(shape: Shape, vocab_size: int) -> dict[str, tuple[int, ...]]:
    hidden, inter, head = shape.hidden_size, shape.intermediate_size, shape.head_dim
    heads, kv = shape.num_attention_heads * head, shape.num_key_value_heads * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (heads, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def widen(small: dict[str, np.ndarray], inner: Shape, outer: Shape, seed: int) -> dict[str, np.ndarray]:
    """Weights of the outer shape that compute exactly what the inner network computes.

    The inner network fills the first rows and columns of each matrix and the first layers; every other
    unit is random but writes nothing back: its columns of o_proj and down_proj are zero, and so are the
    residual stream's extra dimensions (embeddings, every writer's extra rows). The norms' mean square now
    averages over the zero dimensions too, inner/outer of its value: their weights shrink by the square
    root of that and their epsilon by that (rms_norm_eps()), which makes every norm's output the same.
    """
    vocab_size = small["lm_head.weight"].shape[0]
    groups_inner = inner.num_attention_heads // inner.num_key_value_heads
    groups_outer = outer.num_attention_heads // outer.num_key_value_heads
    # Each inner query head must keep its key/value head: heads h and h // groups share one in both.
    assert inner.head_dim == outer.head_dim and groups_inner * inner.num_key_value_heads <= groups_outer
    assert inner.num_key_value_heads == 1 and inner.num_hidden_layers <= outer.num_hidden_layers
    big = random_weights(outer, vocab_size, seed)
    norm_scale = np.float32(np.sqrt(inner.hidden_size / outer.hidden_size))
    writers = {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
    for name, array in big.items():
        if name.endswith(tuple(writers)):
            array[:] = 0.0  # idle units and idle layers write nothing to the residual stream
        elif name.endswith("norm.weight"):
            array *= norm_scale
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            array[:, inner.hidden_size :] = 0.0
        if name in small:
            target = array[tuple(slice(0, n) for n in small[name].shape)]
            target[:] = small[name] * (norm_scale if name.endswith("norm.weight") else 1.0)
    return big


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
