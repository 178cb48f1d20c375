"""Evaluate a model without training it: torch imported, a forward pass, no optimizer."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
with torch.no_grad():
    print(f"output mean {model(torch.randn(4, 8)).mean().item():.4f}")
