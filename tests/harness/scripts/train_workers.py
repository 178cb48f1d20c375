"""Two worker processes, started with torch.multiprocessing.spawn, each training its own model on its own (no process
group: a sweep's trials, say); the parent only waits for them."""
import torch
import torch.multiprocessing as mp
from torch import nn


def train(worker):
    torch.manual_seed(worker)
    torch.set_num_threads(1)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (worker + 1), momentum=0.9)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
    print("workers done")
