"""Writes ``checkpoint_7083df2/``: a checkpoint as forge 7083df2 wrote them, for the resume test.

Run with 7083df2's forge on the path (``git archive 7083df2 forge | tar -x -C /tmp/old``)::

    PYTHONPATH=/tmp/old python tests/unit/data/make_checkpoint_7083df2.py

The model and optimizer are ``tiny_model_and_optimizer(seed=0, steps=3)`` of
``tests/unit/test_checkpoint.py``; the RNGs are seeded with 5 just before the save.
"""

import random
import shutil
from pathlib import Path

import torch

import forge.checkpoint as checkpoint

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
model[1].weight = model[0].weight
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    model(torch.tensor([1, 2, 3])).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
random.seed(5)
torch.manual_seed(5)
out = Path(__file__).parent / "checkpoint_7083df2"
shutil.rmtree(out, ignore_errors=True)
state = checkpoint.TrainingState(step=3, policy_version=3, extra={"dataset_position": 12})
print(checkpoint.save_checkpoint(out, model, opt, state), "written by", checkpoint.__file__)
