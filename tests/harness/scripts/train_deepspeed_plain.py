"""A DeepSpeed ZeRO-2 training script as a user writes it (it never imports upd), for ``upd record RUN -- torchrun
--nproc_per_node N train_deepspeed_plain.py`` on the CPU (DS_ACCELERATOR=cpu, gloo): train_deepspeed.py's block in
its two param groups (weight decay and none, as the Hugging Face Trainer makes them), AdamW, gradient clipping, its
3 steps on the same global batch split over the ranks. With 1 process it is the training of
``train_deepspeed.reference("adamw", ...)``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed  # noqa: E402

from train_deepspeed import CLIP, GLOBAL_BATCH, STEPS, Block, batch, make_optimizer  # noqa: E402

# No shared-memory all-reduce op to compile (see train_deepspeed.main).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
model = Block()
config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
          "gradient_clipping": CLIP, "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer("adamw", model), config=config)
for step in range(STEPS):
    tokens, targets = batch(step)
    loss = engine(tokens[rank::world], targets[rank::world])
    engine.backward(loss)
    engine.step()
torch.distributed.destroy_process_group()  # an exit with a live gloo group can abort at interpreter teardown
