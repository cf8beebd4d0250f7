"""Models Ollama has pulled: `--model qwen3:0.6b` (Ollama's own name), or the path of a model's manifest.

Ollama keeps a model as a manifest and content-addressed blobs (its manifest format is documented in Ollama's
source, server/internal/manifest): `<models>/manifests/<registry>/<namespace>/<model>/<tag>` is a JSON object
whose "layers" list each part with its "mediaType" and "digest"; the weights are the layer of media type
`application/vnd.ollama.image.model`, a GGUF file stored as `<models>/blobs/sha256-<hex>`. `<models>` is
$OLLAMA_MODELS, else ~/.ollama/models, else /usr/share/ollama/.ollama/models (Ollama's Linux service);
the registry is registry.ollama.ai or ollama.com, the namespace "library" for a name without one.

nanoqwen reads only the weights layer, a GGUF file like any other (model_loader/gguf_file.py): its metadata
holds the tokenizer and the chat template. Ollama's own template (Go's template language) and parameter layers
are not read: the GGUF's Jinja template and generation defaults stand in for them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from nanoqwen.errors import ModelNotFoundError

MODEL_LAYER = "application/vnd.ollama.image.model"
REGISTRIES = ("registry.ollama.ai", "ollama.com")
# qwen3, qwen3:0.6b, library/qwen3:8b, someone/qwen3-fine:q4_k_m (a hub id has no tag)
OLLAMA_NAME = re.compile(r"^(?:(?P<namespace>[\w.-]+)/)?(?P<model>[\w.-]+):(?P<tag>[\w.-]+)$")


def ollama_models_dirs() -> list[Path]:
    """Where Ollama keeps its models, in the order it would be looked for."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path("~/.ollama/models").expanduser(), Path("/usr/share/ollama/.ollama/models")]


def find_ollama_manifest(name: str) -> Path | None:
    """The manifest of an Ollama model name like `qwen3:0.6b` in Ollama's store, or None (not an Ollama name, or
    not pulled)."""
    match = OLLAMA_NAME.match(name)
    if match is None:
        return None
    namespace = match["namespace"] or "library"
    for models in ollama_models_dirs():
        for registry in REGISTRIES:
            manifest = models / "manifests" / registry / namespace / match["model"] / match["tag"]
            if manifest.is_file():
                return manifest
    return None


def is_ollama_manifest(path: Path) -> bool:
    """Whether a file is an Ollama manifest: a JSON object with a "layers" list (read only if it is small)."""
    if not path.is_file() or path.stat().st_size > 1 << 20:
        return False
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and isinstance(manifest.get("layers"), list)


def ollama_gguf(manifest_path: Path) -> Path:
    """The GGUF blob an Ollama manifest names as its weights."""
    manifest = json.loads(manifest_path.read_text())
    layers = [layer for layer in manifest["layers"] if isinstance(layer, dict)]
    weights = [layer for layer in layers if layer.get("mediaType") == MODEL_LAYER]
    if len(weights) != 1:
        kinds = ", ".join(sorted({str(layer.get("mediaType")) for layer in layers})) or "none"
        raise ModelNotFoundError(f"Ollama manifest {manifest_path} has {len(weights)} weights layers "
                                 f"({MODEL_LAYER}), not one (its layers: {kinds}); nanoqwen runs GGUF models")
    digest = str(weights[0].get("digest", ""))
    # <models>/manifests/<registry>/<namespace>/<model>/<tag>: the store is four levels above the registry
    models = next((p.parent for p in manifest_path.resolve().parents if p.name == "manifests"), None)
    blob = models / "blobs" / digest.replace(":", "-") if models is not None else None
    if blob is None or not blob.is_file():
        raise ModelNotFoundError(f"Ollama manifest {manifest_path}: its weights blob {digest} is not in the store "
                                 f"({blob if blob is not None else 'no manifests/ folder above the manifest'}); "
                                 "pull the model again with `ollama pull`")
    return blob
