"""`splitserve pull hf:ORG/NAME`: an HF-layout model from the Hugging Face Hub.

huggingface_hub does the fetching, into its own cache, so its environment applies as
everywhere else: HF_HOME (where the cache lives), HF_TOKEN (gated and private repos) and
HF_HUB_OFFLINE=1 (the cache only, no network). Only what the engine reads is fetched: the
config, the safetensors (sharded or not) and the tokenizer, chat template and generation
config files. The snapshot directory is returned as it is; the engine serves it with
`--model-dir`. A model whose architecture the engine does not serve is refused here, with
the same message the engine gives.
"""

from __future__ import annotations

from pathlib import Path

from shared.engine.model_config import ARCHITECTURES, UnsupportedArchitecture

PREFIX = "hf:"
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]


class HubPullError(RuntimeError):
    """The hub (or the local cache, offline) could not provide the model."""


def is_hub_name(name: str) -> bool:
    return name.startswith(PREFIX)


def pull_from_hub(name: str, revision: str | None = None) -> Path:
    """`hf:ORG/NAME` → the directory of its snapshot in the huggingface_hub cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id = name.removeprefix(PREFIX)
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise HubPullError(f"{name!r}: expected hf:ORG/NAME")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError as e:
        raise HubPullError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be "
            f"reached (HF_HUB_OFFLINE, or no network): {e}"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise HubPullError(f"could not fetch {repo_id} from the Hugging Face Hub: {e}") from e
    _check_servable(path)
    return path


def _check_servable(model_dir: Path) -> None:
    from shared.engine.model_config import ModelConfig

    if not (model_dir / "config.json").is_file():
        raise HubPullError(f"{model_dir}: the snapshot has no config.json (not an HF model)")
    try:
        ModelConfig.from_dir(model_dir)
    except UnsupportedArchitecture as e:
        raise HubPullError(str(e)) from e
    if not any(model_dir.glob("*.safetensors")):
        raise HubPullError(
            f"{model_dir}: no *.safetensors weights (the engine serves {len(ARCHITECTURES)} "
            "architectures from safetensors only)"
        )
