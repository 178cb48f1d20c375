"""Data-parallel training with DistributedDataParallel on the gloo backend, as started by
`torchrun --nproc_per_node 2 train_ddp.py`: each rank trains on its own slice of the batch."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
for step in range(4):
    part = slice(rank * 32 // world, (rank + 1) * 32 // world)
    loss = nn.functional.cross_entropy(model(x[part]), y[part])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {rank} loss {loss.item():.4f}")
dist.destroy_process_group()
