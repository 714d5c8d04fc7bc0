"""A Python rank in the same torchrun job as torchrun_store_main: rendezvous exactly as
torch.distributed.init_process_group("env://") does (torch's own rendezvous handler, then the
default group's PrefixStore chain for the CPU backend) and do the same exchange, so C++ and Python
ranks must meet in the same keys.

    python torchrun_python_worker.py EXPECTED_WORLD_SIZE agent|rank0
"""
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous


def main() -> int:
    expected_world, mode = int(sys.argv[1]), sys.argv[2]
    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=60)))
    assert world == expected_world, (world, expected_world)
    assert (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True") == (mode == "agent"), mode
    # init_process_group: PrefixStore("default_pg"), the group "0/", the backend's device "cpu/".
    group = dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore("default_pg", store)))
    group.set(f"hello/{rank}", f"rank {rank} of {world}")
    read = []
    for other in range(world):
        value = group.get(f"hello/{other}").decode()
        assert value == f"rank {other} of {world}", (other, value)
        read.append(value)
    group.add("sum", rank + 1)
    group.add("arrived", 1)
    while group.add("arrived", 0) < world:
        time.sleep(0.01)
    total = group.add("sum", 0)
    assert total == world * (world + 1) // 2, total
    group.add("left", 1)
    if rank == 0:
        while group.add("left", 0) < world:
            time.sleep(0.01)
    print(f"rank {rank}/{world} (python): rendezvous ok; read: {', '.join(read)}; sum {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
