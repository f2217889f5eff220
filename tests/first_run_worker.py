"""One process of test_launch's first-run test: a program over both processes' devices whose
compilation takes process 1 `SKEW` seconds longer (its trace sleeps), made by
`distributed.first_run_together`, or called as it is with `bare`.

Usage: first_run_worker.py PORT RANK SKEW [bare] (2 processes, 2 CPU devices each). Prints
`sum <value> traces <count>`.
"""

import sys
import time

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from tunix_train.parallel import distributed  # noqa: E402


def main(port: int, rank: int, skew: float, bare: bool) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    distributed.share_compilation_cache()  # as distributed.initialize does: one key a program
    traces = []

    def total(x):
        traces.append(1)
        if rank == 1:
            time.sleep(skew)  # a compilation this much slower than the other process's
        return x.sum()

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                               np.arange(2 * rank, 2 * rank + 2, dtype=np.float32))
    program = jax.jit(total, out_shardings=NamedSharding(mesh, P()))
    if not bare:
        program = distributed.first_run_together(program, "the test's sum", 120)
    print(f"sum {float(program(x))} traces {len(traces)}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:] == ["bare"])
