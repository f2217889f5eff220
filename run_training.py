"""Train a model: `python run_training.py [hydra overrides]`. See README.md."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from tunix_train import cli, gc_policy
from tunix_train.config import CONFIG_DIR, register_configs

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.run_training(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    gc_policy.collect_less_often()
    cli.before_hydra(sys.argv)  # overrides checked (exit 2), one run dir for hand-started jobs
    main()
