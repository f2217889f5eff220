"""run_training.py with the tests' fault injection (tests/faults.py): for the tests only.

    TUNIX_TRAIN_TEST_FAULTS='{"nan_at_step": 6}' python tests/faulty_training.py [overrides]
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/faults.py

from faults import Faults  # noqa: E402
from tunix_train import cli, gc_policy  # noqa: E402
from tunix_train.config import CONFIG_DIR, register_configs  # noqa: E402
from tunix_train.data import sources  # noqa: E402

register_configs()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    faults = Faults.from_env()
    if faults.check_all_bytes is not None:  # a small file that start-up checks as a large one
        sources.CHECK_ALL_BYTES = faults.check_all_bytes
    cli.run_training(cfg, HydraConfig.get().runtime.output_dir, hooks=faults)


if __name__ == "__main__":
    gc_policy.collect_less_often()
    cli.before_hydra(sys.argv)
    main()
