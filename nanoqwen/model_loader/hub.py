"""Where a model comes from: a local folder, or a Hugging Face hub id downloaded
through huggingface_hub."""

from __future__ import annotations

from pathlib import Path

from nanoqwen.errors import ModelNotFoundError

HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.md"]


def resolve_model_path(model: str) -> Path:
    """A local folder as is; anything else shaped like `org/name` through the Hugging Face hub
    cache."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"--model {model}: expected a model folder, found a file")
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"model folder {model} does not exist; pass a folder with config.json and "
            "*.safetensors, a hub id like Qwen/Qwen3-0.6B, or make one with "
            "`nanoqwen init-random DIR`")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(model, allow_patterns=HUB_FILE_PATTERNS,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached yet: download
    try:
        return Path(snapshot_download(model, allow_patterns=HUB_FILE_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{model} is not a model on the Hugging Face hub "
                                 "(or needs a token: run `hf auth login`)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(
            f"cannot download {model}: the Hugging Face hub is not reachable ({type(e).__name__}); "
            "pass a local folder with --model PATH, or make a random-weight one with "
            "`nanoqwen init-random DIR`") from None
