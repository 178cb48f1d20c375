"""A tiny GAN: a generator and a discriminator, each with its own optimizer (Adam and SGD with momentum)."""
import torch
from torch import nn

torch.manual_seed(0)
torch.set_num_threads(1)
generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
discriminator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-2, momentum=0.9)
bce = nn.BCEWithLogitsLoss()
for step in range(4):
    real = torch.randn(32, 2) * 0.5 + 2.0
    fake = generator(torch.randn(32, 4))
    loss_d = bce(discriminator(real), torch.ones(32, 1)) + bce(discriminator(fake.detach()), torch.zeros(32, 1))
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    loss_g = bce(discriminator(fake), torch.ones(32, 1))
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
print(f"d {loss_d.item():.4f} g {loss_g.item():.4f}")
