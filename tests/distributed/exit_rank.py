"""One rank of a 2-rank gloo job that ends the way a finished fsdp run does: a collective on
temporary tensors (all_gather_object), `teardown_distributed`, then `end_process`, as every
ddptrain process exits.
test_exit.py starts it under torchrun, which sets the rank's place in the environment."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from ddptrain.distributed.env import teardown_distributed
from ddptrain.errors import end_process

torch.set_num_threads(1)
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
fully_shard(model[0])
fully_shard(model)  # from here, DTensor's caches hold the group until the interpreter ends
model(torch.randn(4, 8)).sum().backward()
every = [None] * dist.get_world_size()
dist.all_gather_object(every, dist.get_rank())
assert every == list(range(dist.get_world_size()))
teardown_distributed()
end_process(0)
