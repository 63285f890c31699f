"""The reward-model service: learned scores, batched and sharded, equal to the checkpoint's own.

A real Monarch service whose one replica is two FSDP2 ranks (gloo), against ``transformers``'
sequence-classification model scoring each text alone; and the checks that refuse a checkpoint
that is not a reward model, naming it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge.types import QUESTION, Prompt
from tests.numerics import assert_close_to_scale


def _reward_model(tiny: Path, folder: Path, seed: int) -> Path:
    """A scalar head over the tiny model (random head), saved as ``apps.rm`` exports one."""
    from forge.actors.reward_model import write_prompt_format
    from forge.actors.trainer_pairs import scalar_head_model

    torch.manual_seed(seed)
    model = scalar_head_model(str(tiny), torch.float32, 0)
    with torch.no_grad():  # a head large enough that scores differ from text to text
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    write_prompt_format(folder, "q: {text}", True)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    from forge.models import make_tiny_model

    root = tmp_path_factory.mktemp("rm_service")
    tiny = make_tiny_model(root / "tiny", hidden_size=64, num_layers=2, init_std=0.1)
    return tiny, _reward_model(tiny, root / "rm_a", 0), _reward_model(tiny, root / "rm_b", 1)


def _own_score(folder: Path, question: str, text: str) -> float:
    """The checkpoint's score of one text, as transformers pools it, with the format it was saved with."""
    from transformers import AutoModelForSequenceClassification

    from forge.actors.reward_model import read_prompt_format
    from forge.data.formatting import PromptFormat

    fmt = PromptFormat.from_model(str(folder), *read_prompt_format(folder))
    example = fmt.sft_example(question, text)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(torch.cat([example.prompt_ids, example.answer_ids])[None]).logits[0, 0])


async def test_a_sharded_replica_scores_batches_as_each_model_scores_one_text(models):
    """Two models on a two-rank replica: 12 concurrent singletons and one group get each model's
    own score of each text (the question, not the policy's formatted prompt, goes through the
    model's saved format), in order, and the singletons were scored in batches, not one by one."""
    from forge.actors.reward_model import RewardModel, RewardModelConfig

    _, rm_a, rm_b = models
    questions = [f"{i}+{2 * i}=" for i in range(12)]
    prompts = [Prompt(f"p{i}", f"<formatted>{q}", "", {QUESTION: q}) for i, q in enumerate(questions)]
    texts = [str(i * 7 % 10) * (1 + i % 5) for i in range(12)]
    want = torch.tensor([[_own_score(m, q, t) for m in (rm_a, rm_b)] for q, t in zip(questions, texts)])
    config = RewardModelConfig(model_paths=[str(rm_a), str(rm_b)])
    svc = await RewardModel.options(procs=2, name="rm2", env={"OMP_NUM_THREADS": "1"}).as_service(config)
    try:
        got = await asyncio.wait_for(asyncio.gather(*(svc.score.route((p, t)) for p, t in zip(prompts, texts))), 120)
        assert_close_to_scale(torch.tensor(got), want, 1e-4, what="singleton scores")
        group = await asyncio.wait_for(svc.score_groups.route((prompts[3], texts)), 120)
        want_group = torch.tensor([[_own_score(m, questions[3], t) for m in (rm_a, rm_b)] for t in texts])
        assert_close_to_scale(torch.tensor(group), want_group, 1e-4, what="group scores")
        metrics = [m for rank in await svc.drain_metrics.fanout() for m in rank]
        sizes = [value for name, value, _ in metrics if name == "reward_model/batch_size"]
        assert sizes and max(sizes) > 1 and len(sizes) < 13, sizes  # batched: fewer passes than requests
    finally:
        await svc.shutdown()


def test_a_checkpoint_without_a_scalar_head_is_refused_naming_it(models, tmp_path: Path):
    """A causal LM, a folder that is no checkpoint and a two-label classifier, each named."""
    from transformers import AutoModelForSequenceClassification

    from forge.actors.reward_model import RewardModelConfig, check_reward_checkpoint

    tiny, rm_a, _ = models
    check_reward_checkpoint(rm_a)
    with pytest.raises(ValueError, match=rf"reward model '{tiny}' has no scalar head.*ForCausalLM"):
        check_reward_checkpoint(tiny)
    with pytest.raises(ValueError, match=rf"reward model '{tmp_path}' is not a Hugging Face checkpoint"):
        check_reward_checkpoint(tmp_path)
    two = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=2)
    two.config.architectures = [type(two).__name__]
    two.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="has 2 outputs; a reward model has one"):
        check_reward_checkpoint(tmp_path / "two")
    with pytest.raises(ValueError, match="needs at least one reward model"):
        RewardModelConfig(model_paths=[])
