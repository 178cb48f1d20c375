"""Train a small MLP with Adam on random data; print the final loss.

    python train_mlp.py [--lr LR] [--steps N] [--exit-code K] [--until-signal] [--compile] [--restart-at N]

--exit-code K ends with sys.exit(K) after training; --until-signal prints "ready" after 5 steps and trains on until
it is stopped; --compile trains torch.compile(model); --restart-at N makes a new optimizer at step N (a new phase).
"""
import argparse
import sys
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--exit-code", type=int, default=0)
parser.add_argument("--until-signal", action="store_true")
parser.add_argument("--compile", action="store_true")
parser.add_argument("--restart-at", type=int, default=None)
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


model = MLP()
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
forward = torch.compile(model, backend="eager") if args.compile else model
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
step = 0
while step < args.steps or args.until_signal:
    if step == args.restart_at:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = nn.functional.cross_entropy(forward(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if args.until_signal and step == 5:
        print("ready", flush=True)
    if args.until_signal:
        time.sleep(0.01)
print(f"final loss {loss.item():.4f}")
print("stderr line", file=sys.stderr)
sys.exit(args.exit_code)
