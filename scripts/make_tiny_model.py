"""Write the tiny random-init model and character tokenizer that forge's CPU runs and tests use.

The model loads in transformers and in vLLM like any Hugging Face checkpoint (see
``forge.models.tiny`` for why it looks the way it does). Reuses an existing model with the same
settings; pass --overwrite to replace one made with other settings.

Run:
    .venv/bin/python scripts/make_tiny_model.py /tmp/forge-tiny
    .venv/bin/python scripts/make_tiny_model.py /tmp/forge-tiny-q3 --arch qwen3 --hidden-size 256
    .venv/bin/python scripts/make_tiny_model.py /tmp/forge-tiny-qwen3-1.7b-layout --layout qwen3_1_7b

``--layout`` picks a real checkpoint's layout (``forge.models.tiny.LAYOUTS``): ``tied_stored_head``
(a tied head stored anyway, as Qwen3-1.7B), ``untied``, ``big_vocab`` (151,936 tokens), ``chat``
(``<|im_start|>``/``<|im_end|>`` and a chat template) or ``qwen3_1_7b`` (all of them, on Qwen3).
"""

from __future__ import annotations

import argparse

from forge.models.tiny import ARCHS, LAYOUTS, make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="folder to write the model into")
    parser.add_argument("--arch", choices=ARCHS, default=None, help="model architecture (default qwen2)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tied", help="a real checkpoint's layout")
    parser.add_argument("--hidden-size", type=int, default=128, help="model width, a multiple of 64")
    parser.add_argument("--num-layers", type=int, default=2, help="number of decoder layers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    parser.add_argument("--init-std", type=float, default=0.02, help="std of the normal weight init")
    parser.add_argument("--overwrite", action="store_true", help="replace a model made with other settings")
    args = parser.parse_args()
    layout = dict(LAYOUTS[args.layout])
    arch = args.arch or layout.pop("arch", "qwen2")
    layout.pop("arch", None)
    try:
        path = make_tiny_model(
            args.path,
            arch=arch,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            seed=args.seed,
            init_std=args.init_std,
            overwrite=args.overwrite,
            **layout,
        )
    except ValueError as err:
        parser.error(str(err).replace("overwrite=True", "--overwrite"))
    print(path)


if __name__ == "__main__":
    main()
