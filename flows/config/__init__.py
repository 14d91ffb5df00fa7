"""The run config, one part per owner, loadable from YAML and the command line.

    resources.py   where the trainer runs           training.py    the trainer, optimizer, LoRA
    data.py        prompts and SFT samples          storage.py     tables and checkpoints
    rollout.py     generation and its engines       sync.py        weights to the engines
    reward.py      scoring                          durability.py  retries of transient failures
    algorithm.py   the RL objective                 eval.py / replay.py / logging.py
    run.py         RunConfig: the parts together, the rules between them and per command
    variants.py    typed views of the variants the flat fields choose: the policy loss, LoRA, OPD
    loading.py     YAML + flags -> a checked RunConfig; validation errors as one line

Each part checks its own fields (its `check`); RunConfig checks the rest. The config imports nothing of the
project but infra/errors.py and infra/plugins.py (tests/unit/repo/test_layering.py).
"""

from sluiceway.flows.config.algorithm import AlgorithmConfig
from sluiceway.flows.config.data import DataConfig
from sluiceway.flows.config.durability import DurabilityConfig
from sluiceway.flows.config.eval import EvalConfig
from sluiceway.flows.config.group import Group
from sluiceway.flows.config.loading import build_config, field_flags, flag, format_validation_error, load_yaml
from sluiceway.flows.config.logging import LoggingConfig
from sluiceway.flows.config.replay import ReplayConfig
from sluiceway.flows.config.resources import ResourcesConfig
from sluiceway.flows.config.reward import RewardConfig
from sluiceway.flows.config.rollout import RolloutConfig
from sluiceway.flows.config.run import EvalRunConfig, ReplayRunConfig, RunConfig, validate_for
from sluiceway.flows.config.storage import StorageSettings
from sluiceway.flows.config.sync import SyncConfig
from sluiceway.flows.config.training import LORA_TARGET_NAMES, TrainingConfig
from sluiceway.flows.config.variants import CispoLoss, GspoLoss, LoraPart, OpdPart, PolicyLoss, PpoClipLoss, SapoLoss

__all__ = [
    "field_flags",
    "flag",
    "LORA_TARGET_NAMES",
    "AlgorithmConfig",
    "CispoLoss",
    "DataConfig",
    "DurabilityConfig",
    "EvalConfig",
    "EvalRunConfig",
    "GspoLoss",
    "Group",
    "LoggingConfig",
    "LoraPart",
    "OpdPart",
    "PolicyLoss",
    "PpoClipLoss",
    "ReplayConfig",
    "ReplayRunConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SapoLoss",
    "StorageSettings",
    "SyncConfig",
    "TrainingConfig",
    "build_config",
    "format_validation_error",
    "load_yaml",
    "validate_for",
]
