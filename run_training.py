"""Train a model: `python run_training.py [hydra overrides]`. See README.md."""

import sys

from tunix_train.parallel import torchrun

torchrun.say_why_when_stopped()  # before the imports below, seconds in which torchrun may stop us

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from tunix_train import cli, gc_policy  # noqa: E402
from tunix_train.config import CONFIG_DIR, register_configs  # noqa: E402

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.run_training(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    gc_policy.collect_less_often()
    cli.before_hydra(sys.argv)  # overrides checked (exit 2), one run dir for hand-started jobs
    main()
