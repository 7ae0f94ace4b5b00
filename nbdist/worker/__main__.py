"""``python -m nbdist.worker RUN_DIR``: the rank that torchrun, mpirun and srun start."""

import sys

from nbdist.worker.bootstrap import main

sys.exit(main())
