"""What the checks on the files a run trusts cost: checkpoint save/load and the file transport.

    python benchmarks/trust_checks.py --runs 9 --out trust_checks.json

On the medium model (a random-init Qwen2, 512 wide, 6 layers, 15.8 M parameters) with AdamW
state, one torch thread, in one process, it times (medians of ``--runs``):

- ``save_s``, ``load_s``: ``write_checkpoint`` and ``load_checkpoint`` (DCP, one rank);
- ``read_state_s``: ``read_training_state`` (the state file, ``weights_only=True``);
- ``read_checkpoint_s``: ``read_checkpoint`` (the whole state dict, without a model);
- ``weights_write_s``: the trainer's copy of one version into its kept weight files;
- ``weights_read_s``: the policy's side without vLLM: ``check_weight_file`` (where it exists)
  and mapping the file under its lock (``read_weights``).

To compare with the code before the checks, run the same script with an older checkout first
on ``PYTHONPATH`` (``git archive 3b78b04 forge | tar -x -C /tmp/base``; ``PYTHONPATH=/tmp/base``),
alternating the two so that load drift hits both. Figures: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed repetitions of each operation (medians)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from forge import checkpoint as ck
    from forge.generation import weight_files
    from forge.models import make_tiny_model

    try:  # absent before the checks: then only the mapping is timed
        from forge.generation.weight_folder import check_weight_file
    except ImportError:
        check_weight_file = None

    root = Path(tempfile.mkdtemp(prefix="trust-checks-"))
    try:
        model_dir = make_tiny_model(root / "medium", hidden_size=512, num_layers=6, seed=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        opt.step()
        opt.zero_grad()
        times: dict[str, list[float]] = {k: [] for k in ("save", "load", "read_state", "read_checkpoint")}
        for i in range(args.runs):
            state = ck.TrainingState(i + 1, i, extra={"dataset_position": i})
            t0 = time.perf_counter()
            path = ck.save_checkpoint(root / "checkpoints", model, opt, state)
            t1 = time.perf_counter()
            ck.load_checkpoint(path, model, opt)
            t2 = time.perf_counter()
            ck.read_training_state(path)
            t3 = time.perf_counter()
            ck.read_checkpoint(path)
            t4 = time.perf_counter()
            for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(seconds)
        weights = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        folder = root / "weights"
        files = weight_files.WeightFiles(folder)
        files.write(weights, 0)  # makes the files: not a version's cost
        write, read = [], []
        for version in range(1, 4 * args.runs + 1):
            t0 = time.perf_counter()
            path = files.write(weights, version)
            t1 = time.perf_counter()
            if check_weight_file is not None:
                check_weight_file(path, folder)
            with weight_files.read_weights(path, version) as mapped:
                assert len(mapped) == len(weights)
            read.append(time.perf_counter() - t1)
            write.append(t1 - t0)
        files.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    result.update(
        weights_write_s=statistics.median(write),
        weights_read_s=statistics.median(read),
        checked=check_weight_file is not None,
        runs=args.runs,
        params=sum(p.numel() for p in model.parameters()),
    )
    for key, value in result.items():
        print(f"{key:20s} {value * 1e3:10.2f} ms" if key.endswith("_s") else f"{key:20s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
