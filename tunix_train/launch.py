"""`python -m tunix_train.launch --nprocs=N run_training.py …`: see tunix_train/parallel/launcher.py."""

import sys

from tunix_train.parallel.launcher import main

if __name__ == "__main__":
    sys.exit(main())
