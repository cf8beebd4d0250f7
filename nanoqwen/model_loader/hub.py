"""Where a model comes from: a local folder, or a Hugging Face hub id downloaded
through huggingface_hub."""

from __future__ import annotations

from pathlib import Path

from nanoqwen.errors import ModelNotFoundError
from nanoqwen.model_loader.gguf_file import is_gguf
from nanoqwen.model_loader.ollama import (
    OLLAMA_NAME,
    find_ollama_manifest,
    is_ollama_manifest,
    ollama_gguf,
    ollama_models_dirs,
)

HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.md"]


def resolve_model_path(model: str, gguf_file: str | None = None) -> Path:
    """A local folder as is; a GGUF file as is (a folder with no config.json that holds one .gguf: that file);
    a model Ollama has pulled, by its name (`qwen3:0.6b`) or its manifest's path: the GGUF blob it names
    (model_loader/ollama.py); anything else shaped like `org/name` through the Hugging Face hub cache (with
    gguf_file: that one file of the repo)."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            if is_gguf(path):
                return path
            if is_ollama_manifest(path):
                return ollama_gguf(path)
            raise ModelNotFoundError(f"--model {model}: expected a model folder, a .gguf file or an Ollama "
                                     "manifest, found another file")
        if gguf_file is not None:
            return _gguf_in_folder(path, gguf_file)
        ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
        if not (path / "config.json").is_file() and ggufs:
            if len(ggufs) > 1:
                raise ModelNotFoundError(f"--model {model} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
                                         "pass one of them with --model PATH.gguf (or --gguf-file NAME)")
            return path / ggufs[0]
        return path
    if "/" not in model and (manifest := find_ollama_manifest(f"{model}:latest")) is not None:
        return ollama_gguf(manifest)  # Ollama's name without a tag: its "latest"
    if OLLAMA_NAME.match(model):  # Ollama's name:tag (a hub id has no tag)
        manifest = find_ollama_manifest(model)
        if manifest is None:
            where = " or ".join(str(d) for d in ollama_models_dirs())
            raise ModelNotFoundError(f"--model {model}: no Ollama model of that name in {where} (set OLLAMA_MODELS "
                                     f"to Ollama's models folder, or `ollama pull {model}` first)")
        return ollama_gguf(manifest)
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"model folder {model} does not exist; pass a folder with config.json and "
            "*.safetensors, a .gguf file, a hub id like Qwen/Qwen3-0.6B, or make one with "
            "`nanoqwen init-random DIR`")
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    def fetch(local_only: bool) -> Path:
        if gguf_file is not None:
            return Path(hf_hub_download(model, gguf_file, local_files_only=local_only))
        return Path(snapshot_download(model, allow_patterns=HUB_FILE_PATTERNS, local_files_only=local_only))

    try:
        return fetch(local_only=True)
    except LocalEntryNotFoundError:
        pass  # not cached yet: download
    what = f"{gguf_file} of {model}" if gguf_file else model
    try:
        return fetch(local_only=False)
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{model} is not a model on the Hugging Face hub "
                                 "(or needs a token: run `hf auth login`)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(
            f"cannot download {what}: the Hugging Face hub is not reachable ({type(e).__name__}); "
            "pass a local folder or .gguf file with --model PATH, or make a random-weight one with "
            "`nanoqwen init-random DIR`") from None


def _gguf_in_folder(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        found = sorted(p.name for p in folder.glob("*.gguf"))
        raise ModelNotFoundError(f"--gguf-file {name}: no such file in {folder} "
                                 f"(GGUF files there: {', '.join(found) or 'none'})")
    return path
