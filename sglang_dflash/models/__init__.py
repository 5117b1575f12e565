"""DFlash draft models: config parsing, the draft network and z-lab checkpoint IO."""

from sglang_dflash.models.checkpoint import CheckpointError, load_draft, save_draft, save_draft_vocab
from sglang_dflash.models.config import ConfigError, DFlashConfig, default_target_layer_ids
from sglang_dflash.models.context_cache import ContextCache
from sglang_dflash.models.draft import DFlashDraftModel

__all__ = [
    "CheckpointError", "ConfigError", "ContextCache", "DFlashConfig", "DFlashDraftModel",
    "default_target_layer_ids", "load_draft", "save_draft", "save_draft_vocab",
]
